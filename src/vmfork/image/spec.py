"""What a user's guest image is made of: ``ImageSpec``, from CLI words or a TOML file.

A spec is plain data, checked when it is made (``ImageSpec.validate``), so the
builder never sees a malformed one. The TOML form (``vmfork image build NAME -f
image.toml``) has the CLI's flags as keys; relative paths in it are relative to
the file's directory::

    from = "default"                 # another image, or "default"
    apt = ["python3-numpy", "curl"]
    pip = ["pandas==2.2.3"]
    requirements = "requirements.txt"
    pip_find_links = ["wheels"]      # with pip_no_index = true: build offline
    npm = ["left-pad@1.3.0"]
    copy = ["app:/app", "model.bin:/models/model.bin"]
    env = { MODEL = "/models/model.bin" }   # or ["K=V", ...]
    workdir = "/app"
    user = "1000:1000"
    run = ["pip install requests", "rm -rf /root/.cache"]   # after the steps above
    egress = "allow"                 # the --run steps' network: allow, deny, an allow-list
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from vmfork.image.errors import ImageError

# squashfs: zstd; erofs: lz4hc; erofs-plain: uncompressed, for content that is compressed
# already (model weights, archives), where lz4hc spends minutes per GiB to save nothing.
DISK_FORMATS = ("squashfs", "squashfs-lz4", "erofs", "erofs-plain")
# Where the root lives: a read-only disk under a RAM overlay (the default), or the
# whole tree unpacked into guest RAM as an initramfs (what the default image does; the
# benchmark compares the two for the same content).
ROOTS = ("disk", "initramfs")
DEFAULT_DISK_FORMAT = "erofs"      # measured: docs/images.md, "squashfs or erofs"

MAX_ITEMS = 512          # packages, requirements, copies, env entries: each list
MAX_ENV_VALUE = 32 << 10
MAX_RUN_COMMAND = 64 << 10
MIN_RUN_MEM_MIB, MAX_RUN_MEM_MIB = 128, 65536

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_USER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,31})?")
_NPM = re.compile(r"(@[a-z0-9][a-z0-9._-]*/)?[a-z0-9][a-z0-9._-]{0,213}(@[A-Za-z0-9.^~<>=*|+ -]{1,64})?")
_PIP = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\[\],<>=!~*+ ;:'\"()@/-]{0,255}")


class SpecError(ImageError):
    """The image definition is invalid; the message names the field and what to fix."""


@dataclass(frozen=True)
class CopySpec:
    source: Path          # on the host, absolute
    dest: str             # in the guest, absolute

    def describe(self) -> str:
        return f"{self.source}:{self.dest}"


@dataclass(frozen=True)
class ImageSpec:
    """A guest image definition. Empty lists mean "nothing of that kind"."""

    base: str | None = None                  # image name; None = the default image
    apt: tuple[str, ...] = ()
    pip: tuple[str, ...] = ()
    requirements: Path | None = None         # a requirements file on the host
    pip_index_url: str | None = None
    pip_find_links: tuple[str, ...] = ()
    pip_no_index: bool = False
    npm: tuple[str, ...] = ()
    copy: tuple[CopySpec, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    workdir: str | None = None
    user: str | None = None
    disk_format: str = DEFAULT_DISK_FORMAT
    root: str = "disk"
    # Commands run in a build VM after the steps above, in order, each one's changes
    # the next layer (image/buildrun.py); their network's egress policy; its memory.
    run: tuple[str, ...] = ()
    egress: str | None = None
    run_mem_mib: int = 1024
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def is_default(self) -> bool:
        """Nothing beyond the default image: it is built as the plain initramfs."""
        return (self.base in (None, "default") and not (self.apt or self.pip or self.requirements
                or self.npm or self.copy or self.env or self.workdir or self.user
                or self.run))

    def validate(self) -> ImageSpec:
        for name, items in (("apt", self.apt), ("pip", self.pip), ("npm", self.npm),
                            ("copy", self.copy), ("env", self.env),
                            ("pip_find_links", self.pip_find_links), ("run", self.run)):
            if len(items) > MAX_ITEMS:
                raise SpecError(f"{name}: at most {MAX_ITEMS} entries, not {len(items)}")
        for req in self.pip:
            if not _PIP.fullmatch(req) or req.startswith("-"):
                raise SpecError(f"pip: {req!r} is not a requirement (e.g. numpy==2.0.2); "
                                "pip options are not accepted here")
        for pkg in self.npm:
            if not _NPM.fullmatch(pkg):
                raise SpecError(f"npm: {pkg!r} is not a package spec (e.g. left-pad@1.3.0)")
        if self.requirements is not None and not self.requirements.is_file():
            raise SpecError(f"requirements: {self.requirements} is not a file")
        for c in self.copy:
            if not c.source.exists():
                raise SpecError(f"copy: {c.source} does not exist on this host")
            _guest_path("copy destination", c.dest)
        for key, value in self.env:
            if not _ENV_NAME.fullmatch(key):
                raise SpecError(f"env: {key!r} is not a variable name")
            if "\0" in value or len(value) > MAX_ENV_VALUE:
                raise SpecError(f"env: the value of {key} has a NUL byte or is over 32 KiB")
        if self.workdir is not None:
            _guest_path("workdir", self.workdir)
        if self.user is not None and not _USER.fullmatch(self.user):
            raise SpecError(f"user: {self.user!r} is not NAME, UID, or USER:GROUP")
        if self.root not in ROOTS:
            raise SpecError(f"root: {self.root!r} is not one of {', '.join(ROOTS)}")
        if self.disk_format not in DISK_FORMATS:
            raise SpecError(f"disk_format: {self.disk_format!r} is not one of "
                            f"{', '.join(DISK_FORMATS)}")
        for command in self.run:
            if not command.strip() or "\0" in command or len(command) > MAX_RUN_COMMAND:
                raise SpecError(f"run: {command[:60]!r} must be a non-empty shell command "
                                "without NUL bytes, at most 64 KiB")
        if self.run and self.root != "disk":
            raise SpecError("run: --run steps need the disk root (their changes become "
                            "layers of the disk), not root = initramfs")
        if self.egress is not None:
            if not self.run:
                raise SpecError("egress: the policy is for the network of --run steps; "
                                "there are none")
            from vmfork.image.buildrun import egress_policy
            try:
                egress_policy(self.egress)
            except ValueError as err:
                raise SpecError(f"egress: {err}") from err
        if not MIN_RUN_MEM_MIB <= self.run_mem_mib <= MAX_RUN_MEM_MIB:
            raise SpecError(f"run_mem_mib: {self.run_mem_mib} is not in "
                            f"{MIN_RUN_MEM_MIB}..{MAX_RUN_MEM_MIB}")
        if self.pip_index_url is not None and not re.fullmatch(r"https?://\S{1,2000}",
                                                               self.pip_index_url):
            raise SpecError(f"pip_index_url: {self.pip_index_url!r} is not an http(s) URL")
        return self

    def summary(self) -> dict[str, Any]:
        """What ``image ls`` shows and the record keeps: the definition in words."""
        out: dict[str, Any] = {"from": self.base or "default"}
        for name in ("apt", "pip", "npm"):
            if getattr(self, name):
                out[name] = list(getattr(self, name))
        if self.requirements is not None:
            out["requirements"] = str(self.requirements)
        if self.copy:
            out["copy"] = [c.describe() for c in self.copy]
        if self.env:
            out["env"] = [f"{k}={v}" for k, v in self.env]
        if self.root != "disk":
            out["root"] = self.root
        if self.run:
            out["run"] = list(self.run)
            out["egress"] = self.egress or "allow"
        for name in ("workdir", "user"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


def _guest_path(what: str, path: str) -> str:
    p = PurePosixPath(path)
    if not p.is_absolute() or ".." in p.parts or "\0" in path or len(path) > 1024:
        raise SpecError(f"{what}: {path!r} must be an absolute guest path without '..'")
    return path


def parse_copy(word: str, relative_to: Path | None = None) -> CopySpec:
    """``SRC:DST`` (the last ``:`` separates them, so a host path may hold one)."""
    src, sep, dst = word.rpartition(":")
    if not sep or not src or not dst:
        raise SpecError(f"copy: {word!r} is not SRC:DST (a host path, then an absolute "
                        "guest path)")
    source = Path(src).expanduser()
    if not source.is_absolute():
        source = (relative_to or Path.cwd()) / source
    return CopySpec(source.resolve(), _guest_path("copy destination", dst))


def parse_env(words: list[str] | dict[str, Any]) -> tuple[tuple[str, str], ...]:
    if isinstance(words, dict):
        pairs = [(str(k), v) for k, v in words.items()]
    else:
        pairs = []
        for word in words:
            key, sep, value = str(word).partition("=")
            if not sep:
                raise SpecError(f"env: {word!r} is not K=V")
            pairs.append((key, value))
    for key, value in pairs:
        if not isinstance(value, str):
            raise SpecError(f"env: the value of {key} must be a string")
    return tuple(pairs)


_TOML_KEYS = {"from", "apt", "pip", "requirements", "pip_index_url", "pip_find_links",
              "pip_no_index", "npm", "copy", "env", "workdir", "user", "disk_format", "root",
              "run", "egress", "run_mem_mib"}


def _str_list(tree: dict[str, Any], key: str) -> tuple[str, ...]:
    value = tree.get(key, [])
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SpecError(f"{key}: must be a list of strings")
    return tuple(value)


def spec_from_toml(path: Path) -> ImageSpec:
    """The spec a TOML file defines (see the module docstring)."""
    try:
        tree = tomllib.loads(path.read_text())
    except OSError as err:
        raise SpecError(f"cannot read {path}: {err.strerror}") from err
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise SpecError(f"{path} is not valid TOML: {err}") from err
    unknown = sorted(set(tree) - _TOML_KEYS)
    if unknown:
        raise SpecError(f"{path}: unknown keys {', '.join(unknown)} (known: "
                        f"{', '.join(sorted(_TOML_KEYS))})")
    here = path.resolve().parent

    def local(p: str) -> Path:
        q = Path(p).expanduser()
        return (q if q.is_absolute() else here / q).resolve()

    base = tree.get("from")
    if base is not None and not isinstance(base, str):
        raise SpecError("from: must be an image name")
    requirements = tree.get("requirements")
    if requirements is not None and not isinstance(requirements, str):
        raise SpecError("requirements: must be a path")
    find_links = tuple(str(local(p)) if "://" not in p else p
                       for p in _str_list(tree, "pip_find_links"))
    env_value = tree.get("env", [])
    if not isinstance(env_value, list | dict):
        raise SpecError("env: must be a table or a list of K=V strings")
    for key in ("pip_index_url", "workdir", "user", "disk_format", "root", "egress"):
        if key in tree and not isinstance(tree[key], str):
            raise SpecError(f"{key}: must be a string")
    if "pip_no_index" in tree and not isinstance(tree["pip_no_index"], bool):
        raise SpecError("pip_no_index: must be true or false")
    run_mem = tree.get("run_mem_mib", 1024)
    if isinstance(run_mem, bool) or not isinstance(run_mem, int):
        raise SpecError("run_mem_mib: must be an integer (MiB)")
    return ImageSpec(
        base=base, apt=_str_list(tree, "apt"), pip=_str_list(tree, "pip"),
        requirements=local(requirements) if requirements else None,
        pip_index_url=tree.get("pip_index_url"), pip_find_links=find_links,
        pip_no_index=bool(tree.get("pip_no_index", False)), npm=_str_list(tree, "npm"),
        copy=tuple(parse_copy(w, here) for w in _str_list(tree, "copy")),
        env=parse_env(env_value), workdir=tree.get("workdir"), user=tree.get("user"),
        disk_format=tree.get("disk_format", DEFAULT_DISK_FORMAT), root=tree.get("root", "disk"),
        run=_str_list(tree, "run"), egress=tree.get("egress"), run_mem_mib=run_mem,
    ).validate()
