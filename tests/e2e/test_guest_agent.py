"""The agent in the real guest, over virtio-vsock: exec, eval, files."""

from __future__ import annotations

import hashlib
import os
import time

import pytest

from vmfork.agent.client import AgentError, AgentTimeout
from vmfork.agent.protocol import PROTOCOL_VERSION
from vmfork.runtime.guest import BootedGuest


def test_ping_reports_the_guest_agent(guest: BootedGuest) -> None:
    pong = guest.agent.ping()
    assert pong.pid == 1
    assert pong.protocol == PROTOCOL_VERSION, "the image's agent is not this tree's: " \
        "rebuild it (vmfork image build)"


def test_after_fork_corrects_the_clock_on_its_own_connection(guest: BootedGuest) -> None:
    # Tolerance 0: the step is always sent, so its sign and size are what is checked.
    r = guest.agent.after_fork(os.urandom(64), clock_tolerance_ns=0)
    assert r.clock_step_ns > 0, "the guest was set to the request's send time: behind"
    assert r.reseed.bytes == 64
    before = time.time_ns()
    guest_now = guest.agent.step_time(0)
    after = time.time_ns()
    off = guest_now - (before + after) // 2
    assert abs(off) <= (after - before) // 2 + r.clock_error_bound_ns + 1, \
        f"the guest's clock is {off} ns off the host's after the exchange"


def test_guest_is_our_kernel_with_two_cpus(guest: BootedGuest) -> None:
    result = guest.agent.exec(["sh", "-c", "uname -r; nproc; cat /proc/cmdline"])
    release, ncpu, cmdline = result.stdout.decode().splitlines()
    assert release.startswith("6.1.")
    assert ncpu == "2"
    assert "virtio_mmio.device=" in cmdline


def test_exec_streams_output_while_the_command_runs(guest: BootedGuest) -> None:
    arrivals: list[tuple[float, bytes]] = []
    started = time.monotonic()
    result = guest.agent.exec(
        ["sh", "-c", "echo first; sleep 1; echo second"],
        on_stdout=lambda chunk: arrivals.append((time.monotonic() - started, chunk)))
    assert result.exit_code == 0
    assert b"".join(c for _, c in arrivals) == b"first\nsecond\n"
    first_at = next(t for t, c in arrivals if b"first" in c)
    assert first_at < result.duration - 0.5, "the first line arrived only at the end"


def test_exec_stdin_env_cwd(guest: BootedGuest) -> None:
    result = guest.agent.exec(["sh", "-c", "cat; echo \"$GREETING\"; pwd"], stdin=b"piped\n",
                              env={"GREETING": "hi there"}, cwd="/tmp")
    assert result.stdout == b"piped\nhi there\n/tmp\n"


def test_exec_nonzero_exit_and_stderr(guest: BootedGuest) -> None:
    result = guest.agent.exec("echo oops >&2; exit 42")
    assert result.exit_code == 42
    assert result.stderr == b"oops\n"


def test_exec_timeout_kills_and_says_so(guest: BootedGuest) -> None:
    with pytest.raises(AgentTimeout) as info:
        guest.agent.exec(["sh", "-c", "echo started; sleep 30"], timeout=1.5)
    assert b"started" in info.value.stdout
    # the process is gone
    ps = guest.agent.exec(["sh", "-c", "ps | grep 'sleep 30' | grep -v grep || true"])
    assert b"sleep 30" not in ps.stdout


def test_exec_missing_program_is_a_clear_error(guest: BootedGuest) -> None:
    with pytest.raises(AgentError) as info:
        guest.agent.exec(["/no/such/program"])
    assert info.value.code == "not_found"


def test_eval_expression_statement_exception_in_warm_interpreter(guest: BootedGuest) -> None:
    assert guest.agent.eval("1 + 2").value == "3"
    assert guest.agent.eval("import math\nwarm = math.tau").exception is None
    assert guest.agent.eval("round(warm, 3)").value == "6.283"
    failed = guest.agent.eval("1 / 0")
    assert failed.exception is not None
    assert failed.exception.type == "ZeroDivisionError"
    assert "division by zero" in failed.exception.message
    assert "Traceback" in failed.exception.traceback


def test_ten_mib_file_round_trip(guest: BootedGuest) -> None:
    data = os.urandom(10 << 20)
    guest.agent.write_file("/tmp/blob.bin", data)
    digest = guest.agent.exec(["sha256sum", "/tmp/blob.bin"]).stdout.split()[0].decode()
    assert digest == hashlib.sha256(data).hexdigest()
    assert guest.agent.read_file("/tmp/blob.bin") == data
    assert guest.agent.stat("/tmp/blob.bin").size == len(data)
    guest.agent.remove("/tmp/blob.bin")
    assert "blob.bin" not in [e.name for e in guest.agent.list_dir("/tmp")]


def test_virtio_rng_feeds_the_guest(guest: BootedGuest) -> None:
    rng = guest.agent.exec(["cat", "/sys/class/misc/hw_random/rng_current"]).stdout
    assert rng.strip().startswith(b"virtio_rng")
    sample = guest.agent.exec(["head", "-c", "64", "/dev/hwrng"]).stdout
    assert len(sample) == 64 and len(set(sample)) > 8


def test_background_processes_a_pty_and_watch_in_the_guest(guest: BootedGuest) -> None:
    agent = guest.agent
    cat = agent.start(["cat"], stdin=True)
    agent.send_stdin(cat, b"to the guest\n", eof=True)
    stdout, _, end = agent.wait_process(cat, timeout=30)
    assert (stdout, end.exit_code) == (b"to the guest\n", 0)
    term = agent.start(["sh", "-c", "stty size; tty"], pty=(40, 120))
    stdout, _, end = agent.wait_process(term, timeout=30)
    assert end.exit_code == 0 and b"40 120" in stdout and b"/dev/pts/" in stdout
    agent.mkdir("/tmp/watched", parents=True)
    with agent.watch("/tmp/watched") as watch:
        agent.exec(["touch", "/tmp/watched/new"])
        seen = []
        for _ in range(20):
            seen += watch.events(timeout=1.0)
            if any(e.name == "new" for e in seen):
                break
    assert any((e.name, e.type) == ("new", "create") for e in seen)
