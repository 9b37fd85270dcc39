"""The on-disk encoding of machine state: versioned, checksummed, field-named.

Why this shape (DESIGN.md decision 7): a snapshot outlives the code that wrote
it. A child spawned next month by a newer vmfork must read today's state file,
and a corrupted or truncated file must be refused loudly instead of restoring
a machine with garbage registers. So a state file is

    offset  size  field
    0       8     magic b"VMFKSTAT"            -- "is this a state file at all?"
    8       4     format version, u32 LE (2)   -- bumped when a payload changes shape
    12      4     flags, u32 LE (0)            -- reserved (e.g. compression); non-zero
                                                  is refused by a v1 reader
    16      8     payload length, u64 LE       -- detects truncation and trailing junk
    24      32    SHA-256 of the payload       -- detects corruption before parsing
    56      n     payload: UTF-8 JSON

and the payload is the state tree with dataclass *field names* as keys, so the
schema evolves without bumping the format version: a reader ignores fields it
does not know (a newer writer added them) and fills fields the file lacks from
the dataclass default (an older writer did not have them). Removing a field or
changing its meaning is the breaking change that needs a new field name, or a new
format version with a conversion:

* version 1: the first layout;
* version 2: the same container; the machine state's devices became one list of
  tagged records (``vmm.devices.manager``) instead of a field per device.

A reader takes every version it lists in ``SUPPORTED_VERSIONS``. For an older
version it hands the decoded JSON tree to the target class's classmethod
``upgrade_state_payload(version, tree)``, which returns the tree in today's shape
(``ValueError`` if it cannot); a class without one has the same payload in every
version, so its older files are read as they are. An older vmfork refuses a newer
version by its number, with "upgrade vmfork", rather than misreading it.

A record may be a tagged union: a dataclass with the classmethod
``state_field_types(tree)`` is asked, for each record, the types of the fields that
depend on its other fields (``{"state": VsockState}`` for a record whose ``kind``
says "vsock"); a ``ValueError`` from it (an unknown tag) is a field error there.

JSON rather than a packed binary layout because the state is small (~100 KB for
16 vCPUs, dominated by XSAVE blobs) and read once per restore; field names cost a
few KB, and the file stays inspectable with ``python -m json.tool`` after
skipping the header. Bytes are ``{"$b64": "..."}``; dict keys are strings
(``dict[int, X]`` is written with decimal keys, for MSR indices).

Decoding is driven by the target class's type hints (``typing.get_type_hints``),
compiled once per type into a decoder closure, so a hostile or corrupted payload
can only ever produce a ``StateFormatError`` naming the offending field path,
never a half-built object of the wrong shape. The checksum makes accidental
corruption fail early; the typed decoder makes deliberate corruption fail safely.

Like the rest of ``vmfork.ondisk`` this module imports only the stdlib: the store
reuses ``to_json_value``/``from_json_value`` for its ``meta.json``, and nothing here
may drag the VMM's KVM layer into processes that only read snapshots.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import enum
import hashlib
import json
import math
import os
import re
import struct
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from vmfork.ondisk.durable import write_file_atomic
from vmfork.ondisk.errors import OnDiskError
from vmfork.ondisk.readonly import open_ro

MAGIC = b"VMFKSTAT"
FORMAT_VERSION = 2
SUPPORTED_VERSIONS: tuple[int, ...] = (1, 2)

# magic, version, flags, payload length, sha256(payload)
_HEADER = struct.Struct("<8sIIQ32s")
HEADER_SIZE = _HEADER.size  # 56

T = TypeVar("T")

StateFormatErrorKind = Literal[
    "magic", "version", "flags", "truncated", "trailing", "checksum", "json", "field", "encode",
]


class StateFormatError(OnDiskError):
    """A state file or state tree that cannot be encoded or decoded.

    ``kind`` says which check failed (see ``StateFormatErrorKind``); ``field`` is
    the dotted path of the offending field for ``kind == "field"`` (e.g.
    ``vcpus[3].msrs``); ``path`` is the file, when one was involved.
    """

    def __init__(self, message: str, *, kind: StateFormatErrorKind, field: str | None = None,
                 path: str | None = None, op: str | None = None) -> None:
        super().__init__(message, op=op)
        self.kind: StateFormatErrorKind = kind
        self.field = field
        self.path = path


# --------------------------------------------------------------------------- encoding

def to_json_value(obj: object) -> Any:
    """A dataclass tree as plain JSON values (field-named dicts, ``{"$b64": ...}`` bytes).

    Raises ``StateFormatError(kind="encode")`` for a value the format cannot hold
    (a set, a non-finite float, a dict key that is not str or int).
    """
    try:
        return _encode_value(obj)
    except _FieldError as err:
        where = err.path_text()
        raise StateFormatError(f"cannot encode state: {where + ': ' if where else ''}{err.message}",
                               kind="encode", field=where or None, op="encode_state") from None
    except RecursionError:
        raise StateFormatError("cannot encode state: the tree is nested too deeply "
                               "(a reference cycle?)", kind="encode", op="encode_state") from None


def _encode_value(value: object) -> Any:
    # Ordered by frequency in machine state: ints dominate (registers, MSRs).
    if value is None or isinstance(value, (bool, int, str)):
        if isinstance(value, enum.Enum):
            return _encode_value(value.value)
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _FieldError(f"float {value!r} has no JSON representation")
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"$b64": base64.b64encode(value).decode("ascii")}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict[str, Any] = {}
        for f in dataclasses.fields(value):
            if not f.init:
                continue  # derived in __post_init__; the reader derives it again
            try:
                out[f.name] = _encode_value(getattr(value, f.name))
            except _FieldError as err:
                err.path.insert(0, "." + f.name)
                raise
        return out
    if isinstance(value, (list, tuple)):
        items = []
        for i, item in enumerate(value):
            try:
                items.append(_encode_value(item))
            except _FieldError as err:
                err.path.insert(0, f"[{i}]")
                raise
        return items
    if isinstance(value, dict):
        obj: dict[str, Any] = {}
        for key, item in value.items():
            if isinstance(key, str):
                skey = key
            elif isinstance(key, int) and not isinstance(key, bool):
                skey = str(int(key))
            else:
                raise _FieldError(f"dict key {key!r} is {type(key).__name__}; keys must be str "
                                  "or int")
            try:
                obj[skey] = _encode_value(item)
            except _FieldError as err:
                err.path.insert(0, f"[{skey!r}]")
                raise
        if len(obj) == 1 and "$b64" in obj:
            # Would read back as bytes where the reader has no type hint (Any).
            raise _FieldError('a dict whose only key is "$b64" is reserved for bytes')
        return obj
    if isinstance(value, enum.Enum):
        return _encode_value(value.value)
    raise _FieldError(f"a {type(value).__name__} cannot be stored in a state file; use int, "
                      "float, str, bool, None, bytes, list, tuple, dict or a dataclass")


def encode_state(obj: object, *, version: int = FORMAT_VERSION) -> bytes:
    """The state file bytes (header + checksummed JSON payload) for a dataclass tree.
    ``version`` is for tests that write what an older vmfork wrote (the payload is the
    caller's to shape as that version had it)."""
    if version not in SUPPORTED_VERSIONS:
        raise StateFormatError(f"cannot write state format version {version}", kind="encode",
                               op="encode_state")
    if not (dataclasses.is_dataclass(obj) and not isinstance(obj, type)):
        raise StateFormatError(f"encode_state takes a dataclass instance, not "
                               f"{type(obj).__name__}", kind="encode", op="encode_state")
    payload = json.dumps(to_json_value(obj), ensure_ascii=False, allow_nan=False,
                         separators=(",", ":")).encode("utf-8")
    header = _HEADER.pack(MAGIC, version, 0, len(payload), hashlib.sha256(payload).digest())
    return header + payload


# --------------------------------------------------------------------------- decoding

class _FieldError(Exception):
    """Internal: a value of the wrong shape; ``path`` grows as it propagates outwards."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
        self.path: list[str] = []

    def path_text(self) -> str:
        return "".join(self.path).lstrip(".")


_Decoder = Callable[[Any], Any]
_decoders: dict[object, _Decoder] = {}
_INT_KEY = re.compile(r"-?[0-9]{1,40}")


def _json_type_name(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    return type(value).__name__


def _decoder_for(tp: object) -> _Decoder:
    dec = _decoders.get(tp)
    if dec is None:
        dec = _build_decoder(tp)
        _decoders[tp] = dec
    return dec


def _decode_int(v: Any) -> int:
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    raise _FieldError(f"expected int, found {_json_type_name(v)}")


def _decode_float(v: Any) -> float:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    raise _FieldError(f"expected float, found {_json_type_name(v)}")


def _decode_str(v: Any) -> str:
    if isinstance(v, str):
        return v
    raise _FieldError(f"expected str, found {_json_type_name(v)}")


def _decode_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    raise _FieldError(f"expected bool, found {_json_type_name(v)}")


def _decode_none(v: Any) -> None:
    if v is not None:
        raise _FieldError(f"expected null, found {_json_type_name(v)}")


def _decode_bytes(v: Any) -> bytes:
    if isinstance(v, dict) and len(v) == 1:
        text = v.get("$b64")
        if isinstance(text, str):
            try:
                return base64.b64decode(text, validate=True)
            except (binascii.Error, ValueError):
                raise _FieldError("bytes are not valid base64") from None
    raise _FieldError(f'expected bytes ({{"$b64": "..."}}), found {_json_type_name(v)}')


def _decode_any(v: Any) -> Any:
    # No type hint to go by: plain JSON, except that the reserved bytes shape is bytes.
    if isinstance(v, dict):
        if len(v) == 1 and "$b64" in v:
            return _decode_bytes(v)
        return {k: _decode_any(item) for k, item in v.items()}
    if isinstance(v, list):
        return [_decode_any(item) for item in v]
    return v


def _build_decoder(tp: object) -> _Decoder:
    if tp is Any or tp is object:
        return _decode_any
    if tp is int:
        return _decode_int
    if tp is float:
        return _decode_float
    if tp is str:
        return _decode_str
    if tp is bool:
        return _decode_bool
    if tp is None or tp is type(None):
        return _decode_none
    if tp is bytes:
        return _decode_bytes
    if tp is list:
        return _build_decoder(list[Any])
    if tp is dict:
        return _build_decoder(dict[str, Any])
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _enum_decoder(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _dataclass_decoder(tp)

    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is list:
        return _list_decoder(_decoder_for(args[0]) if args else _decode_any)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            item = _decoder_for(args[0])
            as_list = _list_decoder(item)
            return lambda v: tuple(as_list(v))
        return _fixed_tuple_decoder(tuple(_decoder_for(a) for a in args))
    if origin is dict:
        key_tp, val_tp = args if args else (str, Any)
        if key_tp not in (str, int):
            raise TypeError(f"state dicts need str or int keys, not {key_tp!r}")
        return _dict_decoder(key_tp is int, _decoder_for(val_tp))
    if origin is typing.Union or origin is types.UnionType:
        return _union_decoder(tp, tuple(_decoder_for(a) for a in args))
    raise TypeError(f"type {tp!r} cannot be stored in a state file; use int, float, str, bool, "
                    "None, bytes, list, tuple, dict, an Enum, a dataclass, or a union of these")


def _list_decoder(item: _Decoder) -> _Decoder:
    def decode(v: Any) -> list[Any]:
        if not isinstance(v, list):
            raise _FieldError(f"expected array, found {_json_type_name(v)}")
        out = []
        for i, x in enumerate(v):
            try:
                out.append(item(x))
            except _FieldError as err:
                err.path.insert(0, f"[{i}]")
                raise
        return out
    return decode


def _fixed_tuple_decoder(items: tuple[_Decoder, ...]) -> _Decoder:
    def decode(v: Any) -> tuple[Any, ...]:
        if not isinstance(v, list) or len(v) != len(items):
            raise _FieldError(f"expected an array of {len(items)} items, found "
                              f"{_json_type_name(v)}" + (f" of {len(v)}" if isinstance(v, list)
                                                         else ""))
        out = []
        for i, (dec, x) in enumerate(zip(items, v)):
            try:
                out.append(dec(x))
            except _FieldError as err:
                err.path.insert(0, f"[{i}]")
                raise
        return tuple(out)
    return decode


def _dict_decoder(int_keys: bool, value: _Decoder) -> _Decoder:
    def decode(v: Any) -> dict[Any, Any]:
        if not isinstance(v, dict):
            raise _FieldError(f"expected object, found {_json_type_name(v)}")
        out: dict[Any, Any] = {}
        for k, x in v.items():
            key: str | int = k
            if int_keys:
                if not _INT_KEY.fullmatch(k):
                    raise _FieldError(f"dict key {k[:40]!r} is not a decimal integer")
                key = int(k)
            try:
                out[key] = value(x)
            except _FieldError as err:
                err.path.insert(0, f"[{k[:40]!r}]")
                raise
        return out
    return decode


def _union_decoder(tp: object, arms: tuple[_Decoder, ...]) -> _Decoder:
    def decode(v: Any) -> Any:
        # First arm that accepts the value wins. `X | None` is the common case and is
        # unambiguous; unions of two dataclasses decode as the first that fits.
        for arm in arms:
            try:
                return arm(v)
            except _FieldError:
                continue
        raise _FieldError(f"expected {_type_text(tp)}, found {_json_type_name(v)}")
    return decode


def _enum_decoder(cls: type[enum.Enum]) -> _Decoder:
    def decode(v: Any) -> enum.Enum:
        try:
            return cls(v)
        except (ValueError, TypeError):
            raise _FieldError(f"{str(v)[:40]!r} is not a {cls.__name__}") from None
    return decode


def _dataclass_decoder(cls: type) -> _Decoder:
    # Field decoders are resolved on first use so that self-referential dataclasses
    # (a tree node holding a list of nodes) do not recurse while building.
    plan: list[tuple[str, _Decoder, bool]] | None = None

    def resolve() -> list[tuple[str, _Decoder, bool]]:
        try:
            hints = typing.get_type_hints(cls)
        except NameError as err:
            raise TypeError(f"cannot resolve the type hints of {cls.__qualname__} ({err}); "
                            "state classes must be defined at module level") from err
        built = []
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            has_default = (f.default is not dataclasses.MISSING
                           or f.default_factory is not dataclasses.MISSING)
            built.append((f.name, _decoder_for(hints[f.name]), has_default))
        return built

    tagged = getattr(cls, "state_field_types", None)

    def decode(v: Any) -> Any:
        nonlocal plan
        if plan is None:
            plan = resolve()  # built whole, then published: safe if two threads race here
        if not isinstance(v, dict):
            raise _FieldError(f"expected object ({cls.__name__}), found {_json_type_name(v)}")
        chosen: dict[str, _Decoder] = {}
        if tagged is not None:
            try:
                chosen = {name: _decoder_for(tp) for name, tp in tagged(v).items()}
            except ValueError as err:
                raise _FieldError(str(err)) from None
        kwargs: dict[str, Any] = {}
        for name, dec, has_default in plan:
            dec = chosen.get(name, dec)
            if name in v:
                try:
                    kwargs[name] = dec(v[name])
                except _FieldError as err:
                    err.path.insert(0, "." + name)
                    raise
            elif not has_default:
                missing = _FieldError(f"missing (field {cls.__name__}.{name} has no default)")
                missing.path.insert(0, "." + name)
                raise missing
        # Unknown keys in `v` are ignored on purpose: a newer writer added them.
        try:
            return cls(**kwargs)
        except Exception as exc:  # noqa: BLE001 - __post_init__ refusing hostile values
            raise _FieldError(f"{cls.__name__} rejected the decoded values: {exc}") from None
    return decode


def _type_text(tp: object) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def from_json_value(value: Any, cls: type[T]) -> T:
    """Rebuild a ``cls`` from plain JSON values, as written by ``to_json_value``.

    Raises ``StateFormatError(kind="field")`` naming the field path on any mismatch.
    Raises ``TypeError`` if ``cls`` itself uses a type the format cannot hold (a bug
    in the class, not in the data).
    """
    decoder = _decoder_for(cls)
    try:
        return typing.cast(T, decoder(value))
    except _FieldError as err:
        where = err.path_text()
        name = getattr(cls, "__name__", str(cls))
        raise StateFormatError(
            f"state does not match {name}: "
            f"{'field ' + repr(where) + ': ' if where else ''}{err.message}",
            kind="field", field=where or None, op="decode_state") from None
    except RecursionError:
        raise StateFormatError(f"state does not match {getattr(cls, '__name__', cls)}: "
                               "nested too deeply", kind="field", op="decode_state") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def decode_state(data: bytes, cls: type[T]) -> T:
    """Check the header and checksum of state file bytes and rebuild a ``cls``.

    Every failure is a ``StateFormatError`` whose ``kind`` says which check failed.
    """
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"decode_state needs a dataclass type, not {cls!r}")
    view = memoryview(data)
    if len(view) < HEADER_SIZE:
        prefix = bytes(view[:len(MAGIC)])
        if not prefix or prefix != MAGIC[:len(prefix)]:
            raise StateFormatError(
                f"not a vmfork state file: {len(view)} bytes without the {MAGIC.decode()} magic",
                kind="magic", op="decode_state")
        raise StateFormatError(
            f"truncated state file: {len(view)} bytes, shorter than the {HEADER_SIZE}-byte "
            "header; the snapshot was not completely written, take it again",
            kind="truncated", op="decode_state")
    magic, version, flags, length, digest = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise StateFormatError(
            f"not a vmfork state file: starts with {magic!r}, expected {MAGIC!r}",
            kind="magic", op="decode_state")
    if version not in SUPPORTED_VERSIONS:
        supported = ", ".join(str(v) for v in SUPPORTED_VERSIONS)
        hint = ("written by a newer vmfork; upgrade vmfork to read it" if version > FORMAT_VERSION
                else "take the snapshot again with this vmfork")
        raise StateFormatError(
            f"unsupported state format version {version} (this vmfork reads version "
            f"{supported}): {hint}", kind="version", op="decode_state")
    if flags != 0:
        raise StateFormatError(
            f"unsupported state file flags {flags:#x} (version {version} defines none): "
            "written by a newer vmfork; upgrade vmfork to read it", kind="flags",
            op="decode_state")
    payload = view[HEADER_SIZE:]
    if len(payload) < length:
        raise StateFormatError(
            f"truncated state file: payload is {len(payload)} of {length} declared bytes; the "
            "snapshot was not completely written, take it again", kind="truncated",
            op="decode_state")
    if len(payload) > length:
        raise StateFormatError(
            f"state file has {len(payload) - length} bytes of trailing data after the "
            f"{length}-byte payload; it is corrupted, take the snapshot again",
            kind="trailing", op="decode_state")
    if hashlib.sha256(payload).digest() != digest:
        raise StateFormatError(
            "state file checksum mismatch: the payload does not match its SHA-256; the file "
            "is corrupted, take the snapshot again", kind="checksum", op="decode_state")
    try:
        tree = json.loads(str(payload, "utf-8"), parse_constant=_reject_constant)
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
        raise StateFormatError(
            f"state file payload is not valid UTF-8 JSON ({str(err)[:200]}) although its "
            "checksum matches: it was written by a broken writer", kind="json",
            op="decode_state") from None
    if version != FORMAT_VERSION:
        tree = _upgrade(tree, version, cls)
    return from_json_value(tree, cls)


def _upgrade(tree: Any, version: int, cls: type[T]) -> Any:
    upgrade = getattr(cls, "upgrade_state_payload", None)
    if upgrade is None:
        return tree   # the class's payload is the same in every version
    try:
        return upgrade(version, tree)
    except ValueError as err:
        raise StateFormatError(
            f"state format version {version} does not convert to {cls.__name__}: {err}",
            kind="field", op="decode_state") from None


# --------------------------------------------------------------------------- files

def write_state_file(path: str | os.PathLike[str], obj: object) -> int:
    """Encode ``obj`` and write it atomically to ``path``; returns the file size in bytes."""
    data = encode_state(obj)
    write_file_atomic(path, data)
    return len(data)


def read_state_file(path: str | os.PathLike[str], cls: type[T]) -> T:
    """Read and decode a state file; ``StateFormatError`` (with ``.path``) if it is bad,
    ``OnDiskError`` if it cannot be read at all."""
    try:
        with open(open_ro(str(path)), "rb") as f:   # pre-opened for a jailed VMM
            data = f.read()
    except OSError as err:
        raise OnDiskError(f"cannot read state file {path}: {err.strerror or err}",
                          op="read_state_file", errno=err.errno) from err
    try:
        return decode_state(data, cls)
    except StateFormatError as err:
        raise StateFormatError(f"{path}: {err}", kind=err.kind, field=err.field,
                               path=str(path), op="read_state_file") from None
