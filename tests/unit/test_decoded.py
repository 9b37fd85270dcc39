"""``ondisk.decoded.DecodedFiles``: a file's decoded value, kept while its identity holds."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vmfork.ondisk import decoded
from vmfork.ondisk.decoded import DecodedFiles


@pytest.fixture(autouse=True)
def settled_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """These files are seconds old at most: kept as if settled (but the test below)."""
    monkeypatch.setattr(decoded, "SETTLED_S", 0.0)


def counting_reader(calls: list[str]):
    def decode(path: str) -> bytes:
        calls.append(os.path.basename(path))
        return Path(path).read_bytes()
    return decode


def test_a_file_is_decoded_once_while_it_is_the_same_file(tmp_path: Path) -> None:
    calls: list[str] = []
    files = DecodedFiles(counting_reader(calls))
    path = tmp_path / "state.bin"
    path.write_bytes(b"one")
    assert files.get(str(path)) == b"one"
    assert files.get(str(path)) == b"one"
    assert calls == ["state.bin"]


def test_a_replaced_file_is_decoded_again(tmp_path: Path) -> None:
    calls: list[str] = []
    files = DecodedFiles(counting_reader(calls))
    path = tmp_path / "state.bin"
    path.write_bytes(b"one")
    files.get(str(path))
    # Published again: a new file renamed over the old one (a new inode).
    new = tmp_path / "state.bin.new"
    new.write_bytes(b"two")
    os.replace(new, path)
    assert files.get(str(path)) == b"two"
    # Rewritten in place (the store never does): its size and mtime tell.
    path.write_bytes(b"three")
    os.utime(path, ns=(0, 12345))
    assert files.get(str(path)) == b"three"
    assert calls == ["state.bin"] * 3


def test_a_failed_decode_keeps_nothing(tmp_path: Path) -> None:
    attempts: list[str] = []

    def decode(path: str) -> bytes:
        attempts.append(path)
        data = Path(path).read_bytes()
        if data == b"bad":
            raise ValueError("does not decode")
        return data

    files = DecodedFiles(decode)
    path = tmp_path / "state.bin"
    path.write_bytes(b"bad")
    for _ in range(2):
        with pytest.raises(ValueError):
            files.get(str(path))
    assert len(attempts) == 2
    with pytest.raises(FileNotFoundError):
        files.get(str(tmp_path / "missing"))


def test_the_oldest_file_goes_first(tmp_path: Path) -> None:
    calls: list[str] = []
    files = DecodedFiles(counting_reader(calls), kept=2)
    paths = []
    for name in ("a", "b", "c"):
        path = tmp_path / name
        path.write_bytes(name.encode())
        paths.append(str(path))
        files.get(str(path))
    files.get(paths[1])   # kept
    files.get(paths[2])   # kept
    files.get(paths[0])   # dropped when c came: decoded again
    assert calls == ["a", "b", "c", "a"]


def test_a_file_too_young_is_decoded_every_time(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # A file changed within SETTLED_S could still be replaced by one of the same identity.
    monkeypatch.setattr(decoded, "SETTLED_S", 3600.0)
    calls: list[str] = []
    files = DecodedFiles(counting_reader(calls))
    path = tmp_path / "meta.json"
    path.write_bytes(b"{}")
    files.get(str(path))
    files.get(str(path))
    assert calls == ["meta.json", "meta.json"]
