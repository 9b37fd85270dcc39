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

from vmfork.server.errors import BadRequest
from vmfork.store import TAG_RULE, is_valid_tag

SANDBOX_ID_RULE = "1 to 64 characters from A-Z, a-z, 0-9, '_' and '-' (e.g. vm-0123456789ab)"
_SANDBOX_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_GUEST_PATH = 4096

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
