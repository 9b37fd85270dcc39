"""What a user's image says commands run with: its environment, working directory
and user (``/.vmfork/image.json``, written by ``vmfork.image.builder``; for an
imported OCI image, its config's ``Env``, ``WorkingDir`` and ``User``).

Read once, at PID 1's set-up; a guest without the file (the default image) runs
commands as before: ``DEFAULT_ENV``, ``/``, root. A request's own ``env`` and ``cwd``
still win. The file is part of the read-only image, but it is parsed defensively:
bounded, and a malformed field is logged and ignored, never fatal to PID 1.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from vmfork.agent.protocol import DEFAULT_ENV
from vmfork.agent.request import OpError

IMAGE_JSON = "/.vmfork/image.json"
MAX_IMAGE_JSON = 1 << 20


@dataclass(frozen=True)
class ExecDefaults:
    env: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_ENV))
    cwd: str | None = None
    uid: int | None = None
    gid: int | None = None
    groups: tuple[int, ...] = ()
    problems: tuple[str, ...] = ()


_defaults = ExecDefaults()


def current() -> ExecDefaults:
    return _defaults


@dataclass(frozen=True)
class RunAs:
    """A user a request asked to run as (``user``: a name in the guest's /etc/passwd)."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str


MAX_USER_NAME = 32


def run_as(name: object, op: str) -> RunAs | None:
    """The user a request names in ``user`` (None: the image's default, as before).
    Looked up in the guest's own /etc/passwd and /etc/group; an unknown name is an
    error, never a silent fallback to root."""
    if name is None:
        return None
    if (not isinstance(name, str) or not 0 < len(name) <= MAX_USER_NAME
            or not all(c.isalnum() or c in "._-" for c in name) or name[0] == "-"):
        raise OpError("bad_request", f"{op}: 'user' must be a user name of 1-"
                                     f"{MAX_USER_NAME} letters, digits, '.', '_' or '-', "
                                     f"got {str(name)[:40]!r}")
    entry = _lookup("/etc/passwd", name)
    if entry is None or len(entry) < 6 or not entry[2].isdigit():
        raise OpError("unknown_user", f"{op}: there is no user {name!r} in the guest (not "
                                      "in its /etc/passwd)", user=name)
    uid, gid, groups, home = _resolve_user(name)
    return RunAs(name, uid, gid, groups, home or "/")


def _lookup(path: str, name: str) -> list[str] | None:
    """The colon-separated fields of ``name``'s line in /etc/passwd or /etc/group."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f.read(MAX_IMAGE_JSON).splitlines():
                fields = line.split(":")
                if fields and fields[0] == name:
                    return fields
    except OSError:
        return None
    return None


def _resolve_user(spec: str) -> tuple[int, int, tuple[int, ...], str | None]:
    """``uid, gid, supplementary groups, home`` for ``USER[:GROUP]`` (names or numbers),
    as container runtimes read ``User`` against the image's own passwd and group files."""
    user, _, group = spec.partition(":")
    home = None
    if user.isdigit():
        uid, gid = int(user), int(user)
        for line in _passwd_lines():
            if len(line) > 5 and line[2] == user:
                gid, home = int(line[3]) if line[3].isdigit() else gid, line[5]
                user = line[0]
                break
    else:
        entry = _lookup("/etc/passwd", user)
        if entry is None or len(entry) < 6 or not entry[2].isdigit() or not entry[3].isdigit():
            raise ValueError(f"user {user!r} is not in the image's /etc/passwd")
        uid, gid, home = int(entry[2]), int(entry[3]), entry[5]
    if group:
        if group.isdigit():
            gid = int(group)
        else:
            g = _lookup("/etc/group", group)
            if g is None or len(g) < 3 or not g[2].isdigit():
                raise ValueError(f"group {group!r} is not in the image's /etc/group")
            gid = int(g[2])
    groups: list[int] = []
    try:
        with open("/etc/group", encoding="utf-8", errors="replace") as f:
            for text in f.read(MAX_IMAGE_JSON).splitlines():
                members = text.split(":")
                if len(members) > 3 and members[2].isdigit() and user in members[3].split(","):
                    groups.append(int(members[2]))
    except OSError:
        pass
    return uid, gid, tuple(sorted(set(groups) - {gid})), home


def _passwd_lines() -> list[list[str]]:
    try:
        with open("/etc/passwd", encoding="utf-8", errors="replace") as f:
            return [line.split(":") for line in f.read(MAX_IMAGE_JSON).splitlines()]
    except OSError:
        return []


def load(path: str = IMAGE_JSON) -> ExecDefaults:
    """Read the image's defaults (see the module docstring) and make them current."""
    global _defaults
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_IMAGE_JSON + 1)
    except FileNotFoundError:
        return _defaults
    problems: list[str] = []
    tree: object = None
    problem = "it is over 1 MiB" if len(data) > MAX_IMAGE_JSON else None
    if problem is None:
        try:
            tree = json.loads(data)
        except (ValueError, RecursionError) as err:
            problem = str(err)[:200]
    if problem is None and not isinstance(tree, dict):
        problem = "it is not an object"
    if problem is not None or not isinstance(tree, dict):
        _defaults = ExecDefaults(problems=(f"{path} ignored: {problem}",))
        return _defaults
    env = dict(DEFAULT_ENV)
    for word in tree.get("env") or []:
        if isinstance(word, str) and "=" in word and "\0" not in word:
            key, _, value = word.partition("=")
            env[key] = value
        else:
            problems.append(f"env entry {str(word)[:80]!r} ignored")
    cwd = tree.get("workdir")
    if cwd is not None and (not isinstance(cwd, str) or not os.path.isabs(cwd)):
        problems.append(f"workdir {str(cwd)[:80]!r} ignored: not an absolute path")
        cwd = None
    uid = gid = None
    groups: tuple[int, ...] = ()
    user = tree.get("user")
    if isinstance(user, str) and user and user not in ("root", "0", "0:0"):
        try:
            uid, gid, groups, home = _resolve_user(user)
            if home and "HOME" not in {w.partition("=")[0] for w in tree.get("env") or []
                                       if isinstance(w, str)}:
                env["HOME"] = home
        except ValueError as err:
            problems.append(f"user ignored: {err}")
    _defaults = ExecDefaults(env=env, cwd=cwd, uid=uid, gid=gid, groups=groups,
                             problems=tuple(problems))
    return _defaults
