"""Tag validation: the allow-list, and that hostile tags never reach a path."""

from __future__ import annotations

from pathlib import Path

import pytest

from vmfork.store import InvalidTag, Store, StoreError, is_valid_tag, validate_tag

GOOD = ["a", "Z", "0", "-", "_", "numpy-warm", "A_b-9", "x" * 64, "--help", "tag-0123456789abcdef"]

BAD = [
    "", "x" * 65, ".", "..", "../x", "x/..", "a/b", "/etc/passwd", "a\\b", "a.b", ".hidden",
    "a\0b", "\0", "a b", " a", "a\n", "tag\n", "\ttag", "~", "~root", "$HOME", "a*", "a?",
    "a:b", "a;rm -rf", "é", "caf\u00e9", "\u0430",              # Cyrillic a
    "\uff41",                                                 # fullwidth a
    "a\u200b", "\u2024\u2024",                               # zero-width space; one-dot leader
    "a\u2215b", "\u2044",                                    # division slash; fraction slash
    "\U0001d41a",                                            # mathematical bold a
    "x" * 10_000,
]


@pytest.mark.parametrize("tag", GOOD)
def test_good_tags(tag: str) -> None:
    assert validate_tag(tag) == tag
    assert is_valid_tag(tag)


@pytest.mark.parametrize("tag", BAD)
def test_bad_tags(tag: str) -> None:
    assert not is_valid_tag(tag)
    with pytest.raises(InvalidTag) as info:
        validate_tag(tag)
    message = str(info.value)
    assert "1 to 64 characters" in message and "A-Z" in message
    assert len(message) < 400  # a 10 000-character tag is not echoed whole


@pytest.mark.parametrize("tag", [None, 5, b"abc", ["a"]])
def test_non_string_tags(tag: object) -> None:
    with pytest.raises(InvalidTag, match="must be a string"):
        validate_tag(tag)


def test_invalid_tag_is_a_store_error_and_a_value_error() -> None:
    assert issubclass(InvalidTag, StoreError) and issubclass(InvalidTag, ValueError)


@pytest.mark.parametrize("tag", ["..", "../victim", "victim/..", "../snapshots/x", "."])
def test_every_entry_point_refuses_before_touching_paths(tmp_path: Path, tag: str) -> None:
    # A directory that a traversal would reach, with a plausible snapshot in it.
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "meta.json").write_text("{}")
    store = Store.open(tmp_path / "root")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for call in (store.get, store.begin, store.delete, store.exists):
        with pytest.raises(InvalidTag):
            call(tag)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
