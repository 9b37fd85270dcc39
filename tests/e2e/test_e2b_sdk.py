"""The unmodified E2B SDK (``e2b`` from the package index, pinned, in its own venv)
against ``vmfork serve`` with real guests: an E2B program (tests/e2b_programs/tour.py)
pointed at the daemon by environment variables only — E2B_API_KEY (the daemon's
token), E2B_API_URL and E2B_SANDBOX_URL (the daemon's TCP address). A template is a
snapshot tag."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.e2b_sdk import (
    check_signed_urls,
    check_snapshots,
    check_tour,
    check_users,
    e2b_env,
    run_js_program,
    run_program,
    sdk_python,
)
from tests.mcp_support import RunningDaemon, tcp_daemon

pytestmark = pytest.mark.e2e
TOKEN = "e2b-wire-e2e-token-0123456789"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningDaemon, str]]:
    with tcp_daemon(tmp_path_factory.mktemp("e2b"), token=TOKEN,
                    snapshot="e2b-base") as (d, port):
        yield d, f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("sdk", ["python", "javascript"])
def test_the_e2b_sdk_drives_real_guests(daemon: tuple[RunningDaemon, str], sdk: str) -> None:
    d, url = daemon
    work = f"/tmp/e2b-tour-{sdk}"
    started = time.monotonic()
    if sdk == "python":
        seen = run_program(sdk_python(), "tour", ["e2b-base", work], e2b_env(url, TOKEN),
                           timeout=900)
    else:
        seen = run_js_program("tour", ["e2b-base", work], e2b_env(url, TOKEN), timeout=900)
    elapsed = time.monotonic() - started
    check_tour(seen, work)
    assert d.controller.list_sandboxes() == []
    print(f"\nE2B tour ({sdk} SDK) against real guests: {elapsed:.1f} s")


def test_envd_users_in_a_guest(daemon: tuple[RunningDaemon, str]) -> None:
    """The default image's ``user`` (uid 1000, home /home/user): the SDK's ``user=``
    runs commands as it, in its home, and its files are its own."""
    _, url = daemon
    seen = run_program(sdk_python(), "users", ["e2b-base", "/tmp/e2b-users", "user", "--home"],
                       e2b_env(url, TOKEN), timeout=900)
    # The default user is the image's ``user`` too, as in E2B's templates.
    check_users(seen, "user", 1000, 1000, "/home/user", home=True,
                default=(1000, 1000, "/home/user"))


def test_signed_file_urls_in_a_guest(daemon: tuple[RunningDaemon, str]) -> None:
    _, url = daemon
    seen = run_program(sdk_python(), "signed_urls", ["e2b-base", "/tmp/e2b-signed"],
                       e2b_env(url, TOKEN), timeout=900)
    check_signed_urls(seen)


def test_named_snapshots_in_a_guest(daemon: tuple[RunningDaemon, str]) -> None:
    """create_snapshot is a BRANCH: a sandbox created from it has the guest's files as
    they were at the snapshot, not as the source sandbox changed them after."""
    d, url = daemon
    seen = run_program(sdk_python(), "snapshots", ["e2b-base", "/tmp/e2b-snapshots"],
                       e2b_env(url, TOKEN), timeout=900)
    check_snapshots(seen, isolated=True)
    assert d.controller.list_sandboxes() == []
