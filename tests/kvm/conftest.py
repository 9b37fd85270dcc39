"""Tiny-guest KVM tests finish in seconds (well under a minute in a loaded emulated
host), so each gets a tight time limit: a hang fails that test with every thread's
stack printed (pytest-timeout's thread method), instead of holding the tier for the
suite-wide limit that the long end-to-end tests need."""

from __future__ import annotations

import pytest

KVM_TEST_TIMEOUT_S = 600


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("timeout") is None and "tests/kvm/" in item.nodeid:
            item.add_marker(pytest.mark.timeout(KVM_TEST_TIMEOUT_S))
