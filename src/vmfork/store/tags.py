"""Snapshot tags: the only user-chosen string that becomes part of a store path.

forkd shipped three path-traversal advisories through tags, manifest tags and
parent tags (REFERENCE-forkd.md), each time because a tag was joined to a path
and checked afterwards, or not at all. Here a tag is checked against a strict
ASCII allow-list first, and every function that builds a path from a tag takes
it from ``validate_tag``. The rule is ``[A-Za-z0-9_-]{1,64}``: no dots (so no
``.``/``..`` and no collision with the store's own ``.pending-*`` entries), no
separators, no NUL, no whitespace, no unicode look-alikes (the character classes
are spelled out, not ``\\w``, which would admit them).
"""

from __future__ import annotations

import re

from vmfork.store.errors import InvalidTag

TAG_RULE = "1 to 64 characters from A-Z, a-z, 0-9, '_' and '-'"
_TAG = re.compile(r"[A-Za-z0-9_-]{1,64}")


def is_valid_tag(tag: object) -> bool:
    return isinstance(tag, str) and _TAG.fullmatch(tag) is not None


def validate_tag(tag: object) -> str:
    """Return ``tag`` if it is a valid snapshot tag, else raise ``InvalidTag`` with the rule."""
    if not isinstance(tag, str):
        raise InvalidTag(f"a snapshot tag must be a string, not {type(tag).__name__}; a tag is "
                         f"{TAG_RULE}")
    if _TAG.fullmatch(tag) is None:
        shown = tag if len(tag) <= 80 else tag[:80] + "..."
        raise InvalidTag(f"invalid snapshot tag {shown!r}: a tag is {TAG_RULE} (for example "
                         "'numpy-warm'); choose a tag that follows this rule")
    return tag
