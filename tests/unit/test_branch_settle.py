"""When a diff BRANCH stops waiting for the guest's free page reporting
(``runtime/branch.settled``): after ``SETTLE_QUIET_S`` of this wait without a report,
however long ago the guest last reported (a build's garbage is reported after it ends),
and at ``SETTLE_MAX_S`` for a guest that keeps reporting."""

from __future__ import annotations

from vmfork.runtime.branch import SETTLE_MAX_S, SETTLE_QUIET_S, settled


def test_a_quiet_guest_is_still_waited_for_the_quiet_window() -> None:
    # A guest that reported nothing lately may have freed a build's garbage a moment
    # ago: its report comes ~2 s later, so the wait is never skipped.
    assert not settled(None, 0.0)
    assert not settled(600.0, 0.1)
    assert settled(None, SETTLE_QUIET_S)
    assert settled(600.0, SETTLE_QUIET_S)


def test_a_guest_that_just_reported_is_waited_for_until_quiet() -> None:
    assert not settled(0.5, 1.0)
    assert not settled(1.0, SETTLE_QUIET_S + 1)     # it reported again meanwhile
    assert settled(SETTLE_QUIET_S, SETTLE_QUIET_S + 1)


def test_a_guest_that_keeps_reporting_is_waited_for_at_most_the_cap() -> None:
    assert not settled(0.1, SETTLE_MAX_S - 0.1)
    assert settled(0.1, SETTLE_MAX_S)
