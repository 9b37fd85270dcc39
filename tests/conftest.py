"""Test tiers.

* ``tests/unit`` runs anywhere, no ``/dev/kvm`` needed.
* ``tests/kvm`` (tiny purpose-built guests) and ``tests/e2e`` (the real Linux
  guest) need a KVM that can run unmodified guests: natively on a host with
  hardware virtualisation, or inside the emulated KVM test host
  (``vmfork testhost -- pytest tests/kvm tests/e2e``, which ``scripts/test``
  does). Run natively on a host whose KVM cannot, they are skipped with that
  reason printed (``-rs``); ``scripts/test`` never runs them that way.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

_KVM_TIERS = ("kvm", "e2e")


def _kvm_usable() -> tuple[bool, str]:
    if os.environ.get("VMFORK_IN_TESTHOST") == "1":
        return True, ""
    from vmfork.kvm.probe import native_kvm_runs_guests
    if native_kvm_runs_guests():
        return True, ""
    return False, ("this host's KVM cannot run unmodified guests (see vmfork doctor); run "
                   "these through the emulated test host: scripts/test, or "
                   "vmfork testhost -- python -m pytest tests/kvm tests/e2e")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tier_items = [i for i in items if Path(str(i.fspath)).parent.name in _KVM_TIERS
                  or Path(str(i.fspath)).parent.parent.name in _KVM_TIERS]
    if not tier_items:
        return
    usable, reason = _kvm_usable()
    for item in tier_items:
        item.add_marker(pytest.mark.kvm)
        if not usable:
            item.add_marker(pytest.mark.skip(reason=reason))
