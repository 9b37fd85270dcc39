"""Strict request validation: JSON bodies, query strings and path parameters.

Every field a route accepts is declared with its type, default and bounds; any
other field is refused with its name (a typo such as ``timeout_sec`` must not be
silently ignored and run with the default). Path parameters are checked against
their rule *before* anything looks them up, and after percent-decoding, so
``%2e%2e`` is refused exactly like ``..``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from vmfork.image import InvalidImageName, validate_name
from vmfork.server.errors import BadRequest
from vmfork.store import TAG_RULE, is_valid_tag

SANDBOX_ID_RULE = "1 to 64 characters from A-Z, a-z, 0-9, '_' and '-' (e.g. vm-0123456789ab)"
_SANDBOX_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_GUEST_PATH = 4096
MAX_HOST_PATH = 4096
MAX_LIST_STRING = 4096    # one package, requirement, URL or env value in a list or map
MAX_IMAGE_REF = 2048
IMAGE_NAME_RULE = "1 to 64 letters, digits, '_' or '-'"

_MISSING = object()


@dataclass(frozen=True)
class Field:
    """One accepted field. ``kind`` is the JSON type; ``check`` returns a problem or None."""

    kind: type | tuple[type, ...]
    default: Any = _MISSING
    check: Callable[[Any], str | None] | None = None
    nullable: bool = False

    @property
    def required(self) -> bool:
        return self.default is _MISSING


def _type_name(kind: type | tuple[type, ...]) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
             list: "an array", dict: "an object"}
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _is_kind(value: Any, kind: type | tuple[type, ...]) -> bool:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool):
        return bool in kinds
    if isinstance(value, int) and float in kinds:
        return True
    return isinstance(value, kinds)


def parse_json_object(raw: bytes, where: str) -> dict[str, Any]:
    if not raw.strip():
        return {}
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as err:
        raise BadRequest(f"{where}: the request body is not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise BadRequest(f"{where}: the request body must be a JSON object, not "
                         f"{type(value).__name__}")
    return value


def validate_fields(data: Mapping[str, Any], spec: Mapping[str, Field],
                    where: str) -> dict[str, Any]:
    unknown = sorted(set(data) - set(spec))
    if unknown:
        raise BadRequest(f"{where}: unknown field {unknown[0]!r} in the request body; "
                         f"accepted fields: {', '.join(sorted(spec)) or 'none'}")
    out: dict[str, Any] = {}
    for name, field in spec.items():
        if name not in data:
            if field.required:
                raise BadRequest(f"{where}: missing required field {name!r}")
            out[name] = field.default
            continue
        value = data[name]
        if value is None and field.nullable:
            out[name] = None
            continue
        if not _is_kind(value, field.kind):
            raise BadRequest(f"{where}: field {name!r} must be {_type_name(field.kind)}, "
                             f"not {json.dumps(value)[:60]}")
        if field.check is not None:
            problem = field.check(value)
            if problem is not None:
                raise BadRequest(f"{where}: field {name!r} {problem}")
        out[name] = value
    return out


def parse_query(query: Mapping[str, list[str]], spec: Mapping[str, Field],
                where: str) -> dict[str, Any]:
    """Query parameters, typed by ``spec`` (bool: true/false/1/0; int: decimal)."""
    data: dict[str, Any] = {}
    for name, values in query.items():
        if name not in spec:
            raise BadRequest(f"{where}: unknown query parameter {name!r}; accepted: "
                             f"{', '.join(sorted(spec)) or 'none'}")
        if len(values) != 1:
            raise BadRequest(f"{where}: query parameter {name!r} given {len(values)} times")
        raw = values[0]
        kind = spec[name].kind
        if kind is bool:
            if raw.lower() not in ("true", "false", "1", "0"):
                raise BadRequest(f"{where}: query parameter {name!r} must be true or false, "
                                 f"not {raw[:40]!r}")
            data[name] = raw.lower() in ("true", "1")
        elif kind is int:
            try:
                data[name] = int(raw, 0) if raw.startswith("0o") else int(raw)
            except ValueError:
                raise BadRequest(f"{where}: query parameter {name!r} must be an integer, not "
                                 f"{raw[:40]!r}") from None
        else:
            data[name] = raw
    return validate_fields(data, spec, where)


# -- checks ----------------------------------------------------------------------


def between(low: float, high: float) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        return None if low <= value <= high else f"must be between {low:g} and {high:g}"
    return check


def one_of(*allowed: str) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        return None if value in allowed else f"must be one of {', '.join(allowed)}"
    return check


def check_tag(value: Any) -> str | None:
    return None if is_valid_tag(value) else f"is not a valid tag: a tag is {TAG_RULE}"


def check_guest_path(value: Any) -> str | None:
    if not value.startswith("/"):
        return "must be an absolute path in the guest (start with '/')"
    if "\0" in value:
        return "must not contain NUL"
    if len(value.encode("utf-8", "surrogateescape")) > MAX_GUEST_PATH:
        return f"is longer than {MAX_GUEST_PATH} bytes"
    return None


def check_argv(value: Any) -> str | None:
    if not value:
        return "must be a non-empty array of strings (the program and its arguments)"
    for item in value:
        if not isinstance(item, str):
            return f"must hold only strings, not {json.dumps(item)[:40]}"
        if "\0" in item:
            return "must not contain NUL characters"
    return None


def check_env(value: Any) -> str | None:
    for key, item in value.items():
        if not key or "=" in key or "\0" in key:
            return f"has an invalid variable name {key[:40]!r}"
        if not isinstance(item, str) and item is not None:
            return f"value of {key[:40]!r} must be a string (or null to unset)"
        if isinstance(item, str) and "\0" in item:
            return f"value of {key[:40]!r} must not contain NUL"
    return None


def check_sandbox_id(value: str) -> str:
    if _SANDBOX_ID.fullmatch(value) is None:
        shown = value if len(value) <= 80 else value[:80] + "..."
        raise BadRequest(f"invalid sandbox id {shown!r}: an id is {SANDBOX_ID_RULE}")
    return value


def check_path_tag(value: str) -> str:
    if not is_valid_tag(value):
        shown = value if len(value) <= 80 else value[:80] + "..."
        raise BadRequest(f"invalid snapshot tag {shown!r}: a tag is {TAG_RULE}")
    return value


def check_workspace_name(value: str) -> str:
    if not is_valid_tag(value):
        shown = value if len(value) <= 80 else value[:80] + "..."
        raise BadRequest(f"invalid workspace name {shown!r}: a name is {TAG_RULE}")
    return value


def _utf8(value: str) -> bool:
    # JSON can carry lone surrogates ("\ud800"), which no file, path or process argument
    # can hold; refused here rather than failing deep inside a build.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def text_up_to(limit: int) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if len(value) > limit:
            return f"is longer than {limit} characters"
        return None if _utf8(value) else "is not valid Unicode (a lone surrogate)"
    return check


def check_strings(value: Any) -> str | None:
    for item in value:
        if not isinstance(item, str):
            return f"must hold only strings, not {json.dumps(item)[:40]}"
        if not item or len(item) > MAX_LIST_STRING or "\0" in item or not _utf8(item):
            return (f"holds {item[:40]!r}: each entry is 1 to {MAX_LIST_STRING} characters "
                    "of valid Unicode without NUL")
    return None


def check_string_map(value: Any) -> str | None:
    for key, item in value.items():
        if not isinstance(item, str):
            return f"value of {key[:40]!r} must be a string"
        if len(item) > MAX_LIST_STRING * 8:
            return f"value of {key[:40]!r} is longer than {MAX_LIST_STRING * 8} characters"
        if not (_utf8(key) and _utf8(item)):
            return f"entry {key[:40]!r} is not valid Unicode (a lone surrogate)"
    return None


def _host_path_problem(path: str) -> str | None:
    if not path.startswith("/"):
        return "must be an absolute path on the daemon's host"
    if "\0" in path or len(path) > MAX_HOST_PATH or not _utf8(path):
        return f"must be at most {MAX_HOST_PATH} characters of valid Unicode without NUL"
    return None


def check_copies(value: Any) -> str | None:
    """``[{"src": host path, "dst": guest path}]``; the image spec checks the rest."""
    for i, item in enumerate(value):
        if not isinstance(item, dict) or set(item) != {"src", "dst"} or not all(
                isinstance(v, str) for v in item.values()):
            return (f"entry {i} must be an object {{\"src\": host path, \"dst\": guest "
                    f"path}}, not {json.dumps(item)[:60]}")
        problem = _host_path_problem(item["src"])
        if problem is not None:
            return f"entry {i}: src {item['src'][:80]!r} {problem}"
        problem = (check_guest_path(item["dst"]) if _utf8(item["dst"]) else
                   "is not valid Unicode (a lone surrogate)")
        if problem is not None:
            return f"entry {i}: dst {item['dst'][:80]!r} {problem}"
    return None


def check_host_path(value: Any) -> str | None:
    """A file on the daemon's host (forkd's kernel and rootfs)."""
    return _host_path_problem(value)


def check_find_links(value: Any) -> str | None:
    problem = check_strings(value)
    if problem is not None:
        return problem
    for item in value:
        if not re.fullmatch(r"(https?|file)://\S+", item) and _host_path_problem(item):
            return (f"holds {item[:80]!r}: each entry is an http(s)/file URL or an absolute "
                    "directory on the daemon's host")
    return None


def check_image_name(value: Any) -> str | None:
    try:
        validate_name(value)
    except InvalidImageName:
        return f"is not a valid image name: a name is {IMAGE_NAME_RULE}"
    return None


def check_image_ref(value: Any) -> str | None:
    if (not value or len(value) > MAX_IMAGE_REF or re.search(r"[\s\0]", value)
            or not _utf8(value)):
        return (f"must be an OCI reference (HOST/REPO:TAG, an OCI layout directory, "
                f"oci-archive:PATH or docker-archive:PATH): 1 to {MAX_IMAGE_REF} characters "
                "without whitespace")
    return None


def check_path_image(value: str) -> str:
    if check_image_name(value) is not None:
        shown = value if len(value) <= 80 else value[:80] + "..."
        raise BadRequest(f"invalid image name {shown!r}: a name is {IMAGE_NAME_RULE}")
    return value


def check_pty_size(value: Any) -> str | None:
    """A PTY size object: exactly ``rows`` and ``cols``, integers 1-1000."""
    if set(value) != {"rows", "cols"}:
        return "must be an object with exactly 'rows' and 'cols'"
    for name in ("rows", "cols"):
        dim = value[name]
        if isinstance(dim, bool) or not isinstance(dim, int) or not 1 <= dim <= 1000:
            return f"{name!r} must be an integer from 1 to 1000"
    return None
