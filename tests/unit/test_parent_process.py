"""``runtime.parent.boot_parent``: the parent runs as a process of its own and its
failures come back typed (no guest needed: each case fails before the boot)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vmfork.runtime.parent import ParentFailed, ParentRequest, _classify, boot_parent
from vmfork.store import Store


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store.open(tmp_path / "store")


def test_missing_image_is_typed(store: Store) -> None:
    with pytest.raises(ParentFailed) as caught:
        boot_parent(ParentRequest(tag="a", image="no-such-image-here",
                                  store_root=str(store.root)), timeout=120)
    assert caught.value.kind == "image_missing"
    assert "no-such-image-here" in caught.value.message
    assert store.list() == []


def test_bad_tag_is_invalid(store: Store) -> None:
    with pytest.raises(ParentFailed) as caught:
        boot_parent(ParentRequest(tag="../x", store_root=str(store.root)), timeout=120)
    assert caught.value.kind == "invalid"


@pytest.mark.skipif(os.geteuid() != 0, reason="entering a network namespace needs root")
def test_unknown_namespace_is_a_network_failure(store: Store) -> None:
    with pytest.raises(ParentFailed) as caught:
        boot_parent(ParentRequest(tag="a", network=True, netns="vmfz-999999",
                                  net_tap="tap0", store_root=str(store.root)), timeout=120)
    assert caught.value.kind == "network"
    assert "vmfz-999999" in caught.value.message


def test_egress_without_network_is_refused() -> None:
    from vmfork.runtime.network import EgressPolicy
    with pytest.raises(ParentFailed) as caught:
        boot_parent(ParentRequest(tag="a"), egress=EgressPolicy("deny"))
    assert caught.value.kind == "invalid"


def test_classification_of_the_runtime_errors() -> None:
    from vmfork.image import ImageMissing
    from vmfork.runtime.guest import GuestBootError
    from vmfork.runtime.parent import WarmUpFailed
    from vmfork.store import TagExists
    assert _classify(WarmUpFailed("x")) == "warm_up"
    assert _classify(GuestBootError("x", "")) == "boot"
    assert _classify(ImageMissing("x")) == "image_missing"
    assert _classify(TagExists("t", Path("/s/t"))) == "tag_exists"
    assert _classify(ValueError("x")) == "invalid"
    assert _classify(KeyError("x")) == "internal"


# -- what a jailed parent leaves is checked before it enters the store ---------------

def _staged(tmp_path: Path, data: bytes = b"x" * 4096) -> tuple[Path, Path]:
    staging = tmp_path / "staging"
    staging.mkdir(exist_ok=True)
    source = staging / "memory.bin"
    source.write_bytes(data)
    return source, tmp_path / "memory.bin"


def test_a_staged_file_is_moved_in_and_made_ours(tmp_path: Path) -> None:
    from vmfork.runtime.parent import _take_staged
    source, target = _staged(tmp_path)
    os.chmod(source, 0o666)
    _take_staged(source, target, 1 << 20, os.geteuid())
    assert not source.exists() and target.read_bytes() == b"x" * 4096
    st = target.stat()
    assert st.st_mode & 0o777 == 0o600 and st.st_uid == os.geteuid()


@pytest.mark.parametrize("how", ["symlink", "hard link", "too large", "other owner",
                                 "directory", "missing"])
def test_a_staged_file_that_is_not_the_jails_own_is_refused(tmp_path: Path, how: str) -> None:
    from vmfork.runtime.parent import _take_staged
    secret = tmp_path / "host-secret"
    secret.write_bytes(b"secret")
    source, target = _staged(tmp_path)
    owner = os.geteuid()
    if how == "symlink":
        source.unlink()
        source.symlink_to(secret)
    elif how == "hard link":
        source.unlink()
        os.link(secret, source)
    elif how == "directory":
        source.unlink()
        source.mkdir()
    elif how == "missing":
        source.unlink()
    elif how == "other owner":
        owner += 1
    limit = 100 if how == "too large" else 1 << 20
    with pytest.raises(ParentFailed) as caught:
        _take_staged(source, target, limit, owner)
    assert caught.value.kind == "crashed"
    assert not target.exists() and secret.read_bytes() == b"secret"


def test_the_result_a_jailed_parent_writes_is_read_as_a_typed_record(tmp_path: Path) -> None:
    import json

    from vmfork.runtime.parent import _read_result
    path = tmp_path / "result.json"
    good = {"boot_s": 1.0, "warm_s": 2.0, "pause_ms": 3.0, "capture_ms": 4.0,
            "memory_write_ms": 5.0, "memory_bytes": 6}
    path.write_text(json.dumps({"ok": True, "result": {**good, "extra": "ignored"}}))
    assert _read_result(path) == {"ok": True, "result": good}
    for bad in ({"ok": True, "result": {**good, "boot_s": "1\r\nX: y"}},
                {"ok": True, "result": {**good, "memory_bytes": -1}},
                {"ok": False, "kind": "not-a-kind", "message": "m"},
                {"ok": False, "kind": "warm_up", "message": 5}, [1, 2]):
        path.write_text(json.dumps(bad))
        assert _read_result(path) is None, bad
    path.write_text(json.dumps({"ok": False, "kind": "warm_up", "message": "m" * 10**6}))
    assert len(_read_result(path)["message"]) <= 4000  # type: ignore[index]
    # A symlink to a host file is not followed (its content never reaches an error).
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"ok": False, "kind": "warm_up", "message": "secret"}))
    path.unlink()
    path.symlink_to(secret)
    assert _read_result(path) is None
    path.unlink()
    path.write_bytes(b"{" * (2 << 20))
    assert _read_result(path) is None


def test_the_balloon_switch_is_read_where_the_request_is_made(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The process that boots a parent runs in a jail's clean environment, so
    ``VMFORK_BALLOON`` is read by the caller and travels in the request's JSON."""
    import json
    from dataclasses import asdict
    monkeypatch.delenv("VMFORK_BALLOON", raising=False)
    assert ParentRequest(tag="on").balloon
    monkeypatch.setenv("VMFORK_BALLOON", "0")
    request = ParentRequest(tag="off")
    monkeypatch.delenv("VMFORK_BALLOON")   # as in the jail
    assert not ParentRequest(**json.loads(json.dumps(asdict(request)))).balloon
