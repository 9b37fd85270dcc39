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
