"""The guest's user space, taken from Debian bookworm packages and nothing else.

Why Debian packages: they are signed, versioned and reachable from every
machine that builds vmfork (``apt-get download`` needs no root and no Docker),
and Debian's CPython is the one that the host tests run against.

Which packages: the roots (busybox and CPython's three "minimal/stdlib"
packages) plus their dependency closure from ``apt-cache depends --recurse``,
filtered by two explicit lists. ``ALLOW`` holds what the guest loads at run
time (shared libraries, the MIME table). ``DENY`` holds what the closure drags
in but a guest never needs: maintainer-script helpers (dpkg, perl, tar),
documentation-only packages, and the libraries of the two extension modules
we drop (``nis``, ``_dbm``; see ``initramfs.PRUNED_EXTENSIONS``). A package in
neither list stops the build, so a Debian update that adds a dependency is a
decision for a person, not a silent change to the guest. The build then checks
the result independently (``elf.py``): every ``DT_NEEDED`` must be in the tree.

Everything here except the download reads only local apt metadata, so the
cache key of an already-built initramfs is computed without the network.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from vmfork.image.errors import ImageBuildError

ROOT_PACKAGES: tuple[str, ...] = (
    "busybox-static",
    "python3.11-minimal",
    "libpython3.11-minimal",
    "libpython3.11-stdlib",
    # What users expect of a guest before they add anything (issue 13): a real shell,
    # TLS that verifies, pip for their packages, and the C++ runtime most wheels load.
    "bash",
    "ca-certificates",
    "python3-pip",
    "libstdc++6",
)

# Package -> why the guest needs it.
ALLOW: dict[str, str] = {
    "busybox-static": "/bin/sh and the core utilities, statically linked",
    "python3.11-minimal": "the interpreter, /usr/bin/python3.11",
    "libpython3.11-minimal": "the core standard library (os, io, encodings, ...)",
    "libpython3.11-stdlib": "the rest of the standard library and lib-dynload",
    "libc6": "glibc and the dynamic loader",
    "libgcc-s1": "libgcc_s, which glibc loads for thread cancellation",
    "zlib1g": "zlib, linked by the interpreter",
    "libexpat1": "expat, linked by the interpreter (pyexpat)",
    "libssl3": "libssl/libcrypto for _ssl and _hashlib",
    "libffi8": "libffi for _ctypes",
    "libbz2-1.0": "libbz2 for _bz2",
    "liblzma5": "liblzma for _lzma",
    "libsqlite3-0": "libsqlite3 for _sqlite3",
    "libuuid1": "libuuid for _uuid",
    "libcrypt1": "libcrypt for _crypt",
    "libncursesw6": "ncursesw for _curses",
    "libtinfo6": "terminfo for _curses and readline",
    "libreadline8": "readline for the interactive interpreter",
    "media-types": "/etc/mime.types for the mimetypes module",
    "bash": "the shell users' scripts expect (/bin/sh stays busybox)",
    "base-files": "/etc/os-release, /etc/debian_version and the FHS skeleton",
    "debianutils": "which, run-parts and tempfile (bash depends on it)",
    "mawk": "awk, which scripts and base-files expect",
    "libstdc++6": "the C++ runtime that compiled wheels (numpy, pandas, ...) load",
    "ca-certificates": "the CA bundle, so TLS (pip, urllib, ssl) verifies servers",
    "openssl": "/usr/lib/ssl (the default certificate paths) and the openssl tool",
    "python3": "/usr/bin/python3 and Debian's site configuration (dist-packages)",
    "python3-minimal": "/usr/bin/python3 -> python3.11",
    "python3.11": "the rest of the interpreter package (pydoc, venv support files)",
    "libpython3-stdlib": "the python3 stdlib metapackage's files",
    "python3-pip": "pip, so users can install wheels into the guest",
    "python3-setuptools": "pip's build back end for source distributions",
    "python3-pkg-resources": "setuptools' runtime",
    "python3-wheel": "pip builds and installs wheels with it",
    "python3-distutils": "distutils, which setuptools on 3.11 still imports",
    "python3-lib2to3": "distutils' dependency (its files are pruned)",
}

# Package -> why the guest does without it.
DENY: dict[str, str] = {
    "dpkg": "maintainer scripts only; the guest never installs packages",
    "tar": "pulled in by dpkg",
    "install-info": "documentation index maintenance",
    "perl": "maintainer scripts only",
    "perl-base": "maintainer scripts only",
    "perl-modules-5.36": "maintainer scripts only",
    "libperl5.36": "maintainer scripts only",
    "libgdbm6": "perl's dependency; Python's _gdbm is not in libpython3.11-stdlib",
    "libgdbm-compat4": "perl's dependency",
    "gcc-12-base": "copyright files only",
    "readline-common": "/etc/inputrc and docs; readline works without them",
    "mime-support": "transitional; media-types provides /etc/mime.types",
    "mailcap": "mailcap rules for desktop programs; pulled in by mime-support",
    "libdb5.3": "only for the _dbm module, dropped (dbm.dumb remains)",
    "libnsl2": "only for the deprecated nis module, dropped",
    "libtirpc3": "only for nis",
    "libtirpc-common": "only for nis",
    "libgssapi-krb5-2": "only for nis (via libtirpc3)",
    "libkrb5-3": "only for nis (via libtirpc3)",
    "libkrb5support0": "only for nis (via libtirpc3)",
    "libk5crypto3": "only for nis (via libtirpc3)",
    "libkeyutils1": "only for nis (via libtirpc3)",
    "libcom-err2": "only for nis (via libtirpc3)",
    "libselinux1": "pulled in by dpkg/tar",
    "libpcre2-8-0": "pulled in by libselinux1",
    "libacl1": "pulled in by tar",
    "libmd0": "pulled in by dpkg",
    "libzstd1": "pulled in by dpkg",
    "debconf": "maintainer scripts only (ca-certificates' configuration)",
    "cdebconf": "an alternative to debconf, also maintainer scripts only",
    "libdebian-installer4": "cdebconf's dependency",
    "libnewt0.52": "cdebconf's dependency",
    "libslang2": "cdebconf's dependency",
    "libtextwrap1": "cdebconf's dependency",
    "gawk": "an alternative awk; mawk is the one the guest has",
    "original-awk": "an alternative awk; mawk is the one the guest has",
    "libsigsegv2": "gawk's dependency",
    "libmpfr6": "gawk's dependency",
    "libgmp10": "gawk's dependency",
}

# Packages a user's image never gets from the dependency closure alone (they can still
# ask for them by name): they serve dpkg's maintainer scripts, which never run in a
# guest, and bring perl and dpkg's database along.
MAINTAINER_ONLY: frozenset[str] = frozenset({
    "dpkg", "debconf", "cdebconf", "perl-base", "install-info", "debconf-i18n",
    "libdebian-installer4", "libnewt0.52", "libslang2", "libtextwrap1", "init-system-helpers",
    "sensible-utils", "ucf",
})


@dataclass(frozen=True)
class DebPackage:
    """One pinned package, as apt's local metadata describes its candidate."""

    name: str
    version: str
    architecture: str
    filename: str  # path in the Debian pool, e.g. pool/main/b/busybox/busybox-static_....deb
    sha256: str
    size: int

    @property
    def deb_name(self) -> str:
        """The local file name: the pool's base name (it has no epoch, so no ``%3a``)."""
        return self.filename.rsplit("/", 1)[-1]

    def pin(self) -> str:
        """The line that enters the cache key: name, exact version, arch and hash."""
        return f"{self.name}={self.version} {self.architecture} sha256:{self.sha256}"


def parse_depends_closure(text: str) -> set[str]:
    """Package names from ``apt-cache depends --recurse`` output.

    Every package in the closure appears once as an unindented line; indented
    lines are its dependency edges. Virtual packages appear as ``<name>`` and are
    skipped: some real package provides them and is listed on its own.
    """
    names: set[str] = set()
    for line in text.splitlines():
        if not line or line[0].isspace() or line.startswith("<"):
            continue
        names.add(line.strip())
    return names


def select_packages(closure: Iterable[str]) -> list[str]:
    """The allowed packages of ``closure``, sorted; unknown packages are an error."""
    closure = set(closure)
    unknown = sorted(closure - ALLOW.keys() - DENY.keys())
    if unknown:
        raise ImageBuildError(
            "resolve-packages",
            "the dependency closure now contains packages vmfork has not classified: "
            + ", ".join(unknown)
            + "; add each to ALLOW (the guest needs it) or DENY (it does not) in "
            "src/vmfork/image/debian.py",
        )
    missing_roots = [p for p in ROOT_PACKAGES if p not in closure]
    if missing_roots:
        raise ImageBuildError(
            "resolve-packages",
            f"apt does not know {', '.join(missing_roots)}; run `apt-get update` and check "
            "that a Debian bookworm source is configured",
        )
    return sorted(closure & ALLOW.keys())


_FIELD = re.compile(r"^([A-Za-z0-9-]+):\s*(.*)$")


def parse_package_records(text: str) -> dict[str, DebPackage]:
    """``apt-cache show --no-all-versions`` output -> package name -> record."""
    records: dict[str, DebPackage] = {}
    for block in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        for line in block.splitlines():
            if m := _FIELD.match(line):
                fields[m.group(1)] = m.group(2)
        if "Package" not in fields:
            continue
        try:
            pkg = DebPackage(
                name=fields["Package"],
                version=fields["Version"],
                architecture=fields["Architecture"],
                filename=fields["Filename"],
                sha256=fields["SHA256"],
                size=int(fields["Size"]),
            )
        except (KeyError, ValueError) as err:
            raise ImageBuildError(
                "resolve-packages",
                f"apt's record for {fields['Package']} lacks {err}; run `apt-get update`",
            ) from err
        records.setdefault(pkg.name, pkg)
    return records


def _apt(step: str, cmd: Sequence[str], cwd: Path | None = None) -> str:
    try:
        proc = subprocess.run(list(cmd), cwd=cwd, capture_output=True, text=True, check=False)
    except FileNotFoundError as err:
        raise ImageBuildError(step, f"{cmd[0]} is not installed; the image build needs "
                                    "a Debian (bookworm) host with apt and dpkg") from err
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-10:])
        raise ImageBuildError(step, f"`{' '.join(cmd)}` failed:\n{tail}")
    return proc.stdout


APT_LISTS = Path("/var/lib/apt/lists")
_resolved: dict[tuple[int, tuple[str, ...]], list[DebPackage]] = {}


def _lists_stamp() -> int:
    """Changes whenever ``apt-get update`` rewrites the package lists."""
    try:
        return APT_LISTS.stat().st_mtime_ns
    except OSError:
        return 0


def resolve_packages() -> list[DebPackage]:
    """Pin every guest package to apt's current candidate (local metadata only).

    Remembered per process until apt's lists change: a build resolves the base for its
    tree and for its boot initramfs, and a daemon resolves it for every build."""
    key = (_lists_stamp(), ROOT_PACKAGES)
    if key not in _resolved:
        _resolved.clear()
        _resolved[key] = _resolve_packages()
    return list(_resolved[key])


def _resolve_packages() -> list[DebPackage]:
    closure_text = _apt(
        "resolve-packages",
        ["apt-cache", "depends", "--recurse", "--no-recommends", "--no-suggests",
         "--no-conflicts", "--no-breaks", "--no-replaces", "--no-enhances", *ROOT_PACKAGES],
    )
    names = select_packages(parse_depends_closure(closure_text))
    records = parse_package_records(
        _apt("resolve-packages", ["apt-cache", "show", "--no-all-versions", *names])
    )
    missing = [n for n in names if n not in records]
    if missing:
        raise ImageBuildError(
            "resolve-packages",
            f"apt has no installable version of {', '.join(missing)}; run `apt-get update`",
        )
    return [records[n] for n in names]


def sha256_file(path: Path) -> str:
    """The SHA-256 of a file, hex (read in 1 MiB blocks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def download(packages: Sequence[DebPackage], debs_dir: Path) -> list[Path]:
    """The ``.deb`` of each package in ``debs_dir``, downloading those not there.

    A cached file is trusted only if its SHA-256 matches apt's metadata, so a
    truncated download is fetched again rather than unpacked.
    """
    debs_dir.mkdir(parents=True, exist_ok=True)
    wanted = {p.sha256: p for p in packages
              if not ((debs_dir / p.deb_name).is_file()
                      and sha256_file(debs_dir / p.deb_name) == p.sha256)}
    if wanted:
        # apt-get names files after the version with the epoch URL-encoded; download
        # into a scratch directory and file each .deb under its pool name by hash.
        scratch = Path(tempfile.mkdtemp(prefix=".download-", dir=debs_dir))
        try:
            _apt("download",
                 ["apt-get", "download", "-q", *(f"{p.name}={p.version}" for p in wanted.values())],
                 cwd=scratch)
            for deb in scratch.glob("*.deb"):
                pkg = wanted.pop(sha256_file(deb), None)
                if pkg is not None:
                    deb.replace(debs_dir / pkg.deb_name)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        if wanted:
            raise ImageBuildError(
                "download",
                "apt-get download did not produce the expected file for "
                + ", ".join(p.pin() for p in wanted.values())
                + "; run `apt-get update` and retry",
            )
    return [debs_dir / p.deb_name for p in packages]


def extract(debs: Iterable[Path], staging: Path) -> None:
    """Unpack each package's data into ``staging``; maintainer scripts never run."""
    for deb in debs:
        _apt("extract", ["dpkg-deb", "-x", str(deb), str(staging)])


# -- users' packages (issue 13) --------------------------------------------------------

_PACKAGE_ARG = re.compile(r"[a-z0-9][a-z0-9+.-]{0,127}(=[A-Za-z0-9.+~:-]{1,128})?")


def validate_package_args(packages: Iterable[str]) -> list[str]:
    """``name`` or ``name=version`` words, checked before they reach apt's command line."""
    out: list[str] = []
    for word in packages:
        if not isinstance(word, str) or not _PACKAGE_ARG.fullmatch(word):
            raise ImageBuildError("resolve-packages",
                                  f"{word!r} is not a Debian package name (optionally "
                                  "=version), e.g. python3-numpy or curl=7.88.1-10+deb12u8")
        out.append(word)
    return out


def parse_simulated_install(text: str) -> list[tuple[str, str]]:
    """``(name, version)`` of each ``Inst`` line of ``apt-get -s install`` output."""
    chosen: list[tuple[str, str]] = []
    for line in text.splitlines():
        # Inst libblas3 (3.11.0-2 Debian:12.8/stable [amd64])
        if m := re.match(r"^Inst (\S+) (?:\[[^]]*\] )?\((\S+) ", line):
            chosen.append((m.group(1), m.group(2)))
    return chosen


def resolve_extra_packages(requested: Sequence[str], present: Iterable[str]) -> list[DebPackage]:
    """Pin ``requested`` and their dependency closure, less what ``present`` holds.

    apt's own solver decides the closure (``apt-get -s`` against an empty package
    database, so nothing the build host has installed counts): one provider per
    alternative, as an install would pick, with Recommends off. There is no
    allow-list: whatever the packages need comes along, except ``MAINTAINER_ONLY``
    packages that only the closure (not the user) asked for. Local metadata only.
    """
    words = validate_package_args(requested)
    if not words:
        return []
    out = _apt("resolve-packages",
               ["apt-get", "-s", "-q", "-o", "Dir::State::status=/dev/null",
                "-o", "APT::Install-Recommends=false", "-o", "APT::Get::AllowUnauthenticated=false",
                "install", *words])
    asked = {w.split("=", 1)[0] for w in words}
    have = set(present)
    chosen = [(n, v) for n, v in parse_simulated_install(out)
              if n not in have and (n in asked or n not in MAINTAINER_ONLY)]
    if not chosen:
        return []
    specs = [f"{n}={v}" for n, v in chosen]
    records = parse_package_records(
        _apt("resolve-packages", ["apt-cache", "show", "--no-all-versions", *specs]))
    missing = [n for n, _ in chosen if n not in records]
    if missing:
        raise ImageBuildError("resolve-packages",
                              f"apt has no record of {', '.join(missing)}; run `apt-get update`")
    return [records[n] for n, _ in sorted(chosen)]


_ALTERNATIVE = re.compile(
    r"update-alternatives\s+(?:--quiet\s+)?--install\s+(/\S+)\s+(\S+)\s+(/\S+)\s+(\d+)")


def alternatives(debs: Iterable[Path]) -> dict[str, tuple[str, str]]:
    """``link -> (target, name)``: what the packages' postinst would register with
    ``update-alternatives``, the highest priority per alternative name.

    Maintainer scripts never run in a guest build, but some packages ship a library
    only under an alternative (libblas3 puts ``libblas.so.3`` in ``.../blas/`` and
    links it from the loader's path in its postinst), so the links are made here.
    Only literal ``--install`` lines are understood; a line with shell variables is
    skipped (no package the guest needs has been seen to use one).
    """
    best: dict[str, tuple[int, str, str]] = {}
    for deb in debs:
        proc = subprocess.run(["dpkg-deb", "-I", str(deb), "postinst"], capture_output=True,
                              text=True, check=False)
        if proc.returncode != 0:
            continue  # no postinst
        for m in _ALTERNATIVE.finditer(proc.stdout.replace("\\\n", " ")):
            link, name, target, prio = m.group(1), m.group(2), m.group(3), int(m.group(4))
            if "$" in link + name + target:
                continue
            if name not in best or prio > best[name][0]:
                best[name] = (prio, link, target)
    return {link: (target, name) for _, link, target in best.values()}


def install_alternatives(root: Path, debs: Iterable[Path]) -> int:
    """Make the alternatives' links inside ``root``; return how many were made."""
    made = 0
    for link, (target, _name) in alternatives(debs).items():
        path = root / link.lstrip("/")
        if os.path.lexists(path) or not os.path.lexists(root / target.lstrip("/")):
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.symlink_to(target)
        made += 1
    return made


CA_BUNDLE = "etc/ssl/certs/ca-certificates.crt"


def install_ca_bundle(root: Path) -> int:
    """Write the CA bundle ``update-ca-certificates`` would (the certificates the
    ca-certificates package ships, concatenated); return how many it holds."""
    certs = sorted((root / "usr/share/ca-certificates").rglob("*.crt"))
    if not certs:
        return 0
    bundle = root / CA_BUNDLE
    bundle.parent.mkdir(parents=True, exist_ok=True)
    with open(bundle, "wb") as out:
        for cert in certs:
            data = cert.read_bytes()
            out.write(data if data.endswith(b"\n") else data + b"\n")
    bundle.chmod(0o644)
    return len(certs)
