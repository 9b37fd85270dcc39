"""End-to-end tier: the real Linux guest, booted once per test session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from vmfork.image import find_image
from vmfork.runtime.guest import BootedGuest


@pytest.fixture(scope="session")
def guest() -> Iterator[BootedGuest]:
    with BootedGuest(find_image(), mem_mib=384, vcpus=2) as booted:
        yield booted
