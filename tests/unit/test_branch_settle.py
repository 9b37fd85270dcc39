"""When a diff BRANCH waits for the guest's free page reporting
(``runtime/branch.settled``): a guest that just freed memory (a build that ended) is
waited for until its reports stop, boundedly; an idle guest is branched at once."""

from __future__ import annotations

from vmfork.runtime.branch import SETTLE_IDLE_S, SETTLE_MAX_S, SETTLE_QUIET_S, settled


def test_an_idle_guest_is_not_waited_for() -> None:
    assert settled(None, 0.0, None)                      # never reported
    assert settled(SETTLE_IDLE_S, 0.0, SETTLE_IDLE_S)    # nothing for the idle window
    assert settled(600.0, 0.0, 600.0)


def test_a_guest_that_just_reported_is_waited_for_until_quiet() -> None:
    assert not settled(0.5, 0.0, 0.5)
    # A report 5 s ago is not quiet enough on its own: one may be due any moment.
    assert not settled(5.0, 0.1, 5.0)
    assert not settled(1.0, SETTLE_QUIET_S + 1, 0.5)     # it reported again meanwhile
    assert settled(SETTLE_QUIET_S, SETTLE_QUIET_S, 0.5)


def test_a_guest_that_keeps_reporting_is_waited_for_at_most_the_cap() -> None:
    assert not settled(0.1, SETTLE_MAX_S - 0.1, 0.1)
    assert settled(0.1, SETTLE_MAX_S, 0.1)
