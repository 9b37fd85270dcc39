"""The zygote spawner, end to end: a real zygote process, real forks, real cgroups.

Entries live in ``test_zygote_entries``. Tests that need a memory cgroup (root and a
v1 or v2 memory controller) skip with the reason otherwise; they use a parent group
of their own (``vmfork-test-<pid>``) and remove it afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from vmfork.runtime import cgroups
from vmfork.runtime.supervise import child_pids, leak_snapshot
from vmfork.runtime.zygote_child import VMM_NICE, _vmm_nice
from vmfork.runtime.zygote_client import (
    NO_STACK_CACHE,
    ZygoteClient,
    ZygoteProcess,
    start_zygote,
    with_no_stack_cache,
)
from vmfork.runtime.zygote_protocol import SpawnItem, ZygoteError

HERE = Path(__file__).resolve().parent
E = "test_zygote_entries:"
OOM_SCORE_ADJ_CHILD = 1000
CG_PARENT = f"vmfork-test-{os.getpid()}"

needs_cgroup = pytest.mark.skipif(
    os.geteuid() != 0 or cgroups.detect() is None,
    reason="needs root and a cgroup memory controller (v2 memory.max or v1 memory)")


def _start(tmp: Path) -> ZygoteProcess:
    env = dict(os.environ, PYTHONPATH=str(HERE))
    return start_zygote(tmp / "zygote.sock", env=env, entries_modules=["test_zygote_entries"])


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ZygoteProcess]:
    z = _start(tmp_path_factory.mktemp("zygote"))
    yield z
    assert z.close() == 0
    h = cgroups.detect()
    if h is not None and os.geteuid() == 0:
        report = cgroups.sweep_stale(set(), parent=CG_PARENT, kill=True)
        assert not report.busy
        cgroups.remove_parent(h, CG_PARENT)


@pytest.fixture
def client(zygote: ZygoteProcess) -> Iterator[ZygoteClient]:
    with zygote.client() as c:
        yield c


def _until(pred: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)


def _read_json(path: Path, timeout: float = 10.0) -> Any:
    _until(path.exists, timeout, f"{path}")
    return json.loads(path.read_text())


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


_ids = iter(range(1_000_000))


def vid(prefix: str = "t") -> str:
    return f"{prefix}{next(_ids)}"


# -- exits and reasons ----------------------------------------------------------------


def test_exit_code_is_the_entry_return_value(client: ZygoteClient, tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    child = client.spawn(E + "exit_with", {"code": 7, "log_path": str(log)}, vm_id=vid())
    assert child.pid > 0 and child.cgroup is None
    event = client.wait(child.vm_id)
    assert (event.reason, event.exit_code, event.signal) == ("exited", 7, None)
    assert event.log_tail == ["exiting with 7"]


def test_entry_exception_exits_70_with_traceback_in_log(client: ZygoteClient,
                                                         tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    event = client.wait(client.spawn(E + "raise_error", {"log_path": str(log)},
                                     vm_id=vid()).vm_id)
    assert event.exit_code == 70 and "entry raised" in event.description
    assert event.log_tail[-1] == "RuntimeError: boom from the entry"


def test_a_failed_set_up_step_exits_71_before_the_entry(client: ZygoteClient,
                                                         tmp_path: Path) -> None:
    """The log's directory is a file: the native set-up cannot open the log, says so on
    the zygote's stderr and exits 71; the entry (which would exit 7) never runs."""
    (tmp_path / "not-a-dir").write_text("")
    event = client.wait(client.spawn(E + "exit_with", {
        "code": 7, "log_path": str(tmp_path / "not-a-dir" / "child.log")}, vm_id=vid()).vm_id)
    assert (event.reason, event.exit_code) == ("exited", 71), event


def test_kill_with_a_signal_is_reported_as_killed(client: ZygoteClient) -> None:
    child = client.spawn(E + "sleep", vm_id=vid())
    event = client.kill_and_wait(child.vm_id, signal.SIGTERM)
    assert (event.reason, event.signal, event.kill_requested) == ("killed", 15, True)
    assert "killed by signal 15 (SIGTERM)" in event.description
    assert not _alive(child.pid)


def test_segfault_is_reported_as_crashed(client: ZygoteClient) -> None:
    event = client.wait(client.spawn(E + "segfault", vm_id=vid()).vm_id)
    assert (event.reason, event.signal, event.kill_requested) == ("crashed", 11, False)
    assert "SIGSEGV" in event.description


def test_events_cursor_returns_only_newer_exits(client: ZygoteClient) -> None:
    _, cursor = client.events()
    a, b = vid(), vid()
    client.spawn(E + "exit_with", {"code": 1}, vm_id=a)
    client.wait(a)
    events, cursor2 = client.events(cursor)
    assert [e.vm_id for e in events] == [a]
    client.spawn(E + "exit_with", {"code": 2}, vm_id=b)
    client.wait(b)
    events, _ = client.events(cursor2)
    assert [(e.vm_id, e.exit_code) for e in events] == [(b, 2)]


def test_spawn_many_gives_the_events_cursor_its_children_s_exits_are_newer_than(
        client: ZygoteClient) -> None:
    # An exit before the batch: at or below the cursor the batch's reply gives.
    earlier = vid()
    client.spawn(E + "exit_with", {"code": 1}, vm_id=earlier)
    client.wait(earlier)
    a, b = vid(), vid()
    result = client.spawn_many(E + "exit_with", [SpawnItem(a, {"code": 3}),
                                                 SpawnItem(b, {"code": 4})])
    assert result.events_next is not None
    client.wait(a)
    client.wait(b)
    events, _ = client.events(result.events_next)
    assert sorted((e.vm_id, e.exit_code) for e in events) == sorted([(a, 3), (b, 4)])
    assert {e.pid for e in events} == {c.pid for c in result.children}


def test_a_spawn_item_is_sent_as_given_without_its_unset_fields() -> None:
    args = {"nested": {"deep": [1, 2]}}
    item = SpawnItem("vm-1", args, None, None, {"uid": 5})
    wire = item.to_json()
    assert wire == {"vm_id": "vm-1", "args": {"nested": {"deep": [1, 2]}}, "jail": {"uid": 5}}
    assert wire["args"] is args, "encoded at once: no copy is made"
    assert SpawnItem("vm-2", memory_limit_mib=64, cgroup_parent="p").to_json() == {
        "vm_id": "vm-2", "args": {}, "memory_limit_mib": 64, "cgroup_parent": "p"}


def test_list_shows_running_children_only(client: ZygoteClient) -> None:
    child = client.spawn(E + "sleep", vm_id=vid())
    assert child.vm_id in {c.vm_id for c in client.list()}
    client.kill_and_wait(child.vm_id)
    assert child.vm_id not in {c.vm_id for c in client.list()}


# -- bad requests ---------------------------------------------------------------------


def test_bad_requests_are_refused_with_a_reason(client: ZygoteClient) -> None:
    # Only registered entries run: not an importable function of the stdlib (this one
    # would run a shell command in the zygote's child as root), not a function of a
    # registered module that it did not list, not a module that does not exist.
    for name in ("os:system", "subprocess:run", "no_such_module_xyz:main",
                 E + "no_such_function", "vmfork.runtime.vmmchild:prefork"):
        with pytest.raises(ZygoteError, match="not registered") as err:
            client.spawn(name, {"cmd": "touch /tmp/vmfork-pwned"}, vm_id=vid())
        assert err.value.type == "EntryNotAllowed"
    with pytest.raises(ZygoteError, match="invalid vm_id"):
        client.spawn(E + "sleep", vm_id="../escape")
    with pytest.raises(ZygoteError, match="run_dir"):
        client.spawn(E + "sleep", {"run_dir": "relative/dir"}, vm_id=vid())
    running = client.spawn(E + "sleep", vm_id=vid())
    with pytest.raises(ZygoteError, match="already running") as err:
        client.spawn(E + "sleep", vm_id=running.vm_id)
    assert err.value.type == "AlreadyExists"
    client.kill_and_wait(running.vm_id)
    with pytest.raises(ZygoteError, match="no running child") as err:
        client.kill(running.vm_id)
    assert err.value.type == "NotFound"
    with pytest.raises(ZygoteError, match="unknown op"):
        client.request("frobnicate")
    assert client.ping()["pid"] > 0  # the connection survived all of that


# -- the child contract ---------------------------------------------------------------


def test_child_inherits_no_zygote_fd_and_fresh_signals(zygote: ZygoteProcess,
                                                       client: ZygoteClient,
                                                       tmp_path: Path) -> None:
    # A second connection and a sleeping sibling make sure the zygote holds sockets
    # and pidfds at fork time, so a leak would be visible.
    with zygote.client() as other:
        other.ping()
        sibling = client.spawn(E + "sleep", vm_id=vid())
        zfds = {os.readlink(f"/proc/{zygote.pid}/fd/{fd}")
                for fd in os.listdir(f"/proc/{zygote.pid}/fd")}
        assert any(t.startswith("socket:") for t in zfds)
        assert any("pidfd" in t for t in zfds)
        log = tmp_path / "inspect.log"
        out = tmp_path / "inspect.json"
        child = client.spawn(E + "inspect", {"out": str(out), "log_path": str(log)},
                             vm_id=vid())
        report = _read_json(out)
    client.kill_and_wait(sibling.vm_id)
    assert client.wait(child.vm_id).exit_code == 0
    assert report["fds"] == {"0": "/dev/null", "1": str(log), "2": str(log)}
    assert report["ppid"] == zygote.pid
    assert report["sid"] == report["pid"] == report["pgid"]
    # SIGTERM and SIGINT at their default action: neither caught nor ignored.
    default = (1 << (signal.SIGTERM - 1)) | (1 << (signal.SIGINT - 1))
    assert int(report["sigcgt"], 16) & default == 0
    assert int(report["sigign"], 16) & default == 0
    assert int(report["sigblk"], 16) == 0
    assert report["ctx"] == {"vm_id": child.vm_id, "zygote_pid": zygote.pid, "cgroup": None}
    # Under memory pressure the kernel kills a VMM before the zygote or the daemon.
    assert report["oom_score_adj"] == OOM_SCORE_ADJ_CHILD
    assert int(Path(f"/proc/{zygote.pid}/oom_score_adj").read_text()) < OOM_SCORE_ADJ_CHILD
    # Busy guests yield the CPU to the control plane: the VMM and every thread it
    # starts run at VMM_NICE, the zygote at the nice it was started with.
    assert report["nice"] == report["thread_nice"] == VMM_NICE
    assert os.getpriority(os.PRIO_PROCESS, zygote.pid) == os.getpriority(os.PRIO_PROCESS, 0)
    # No transparent huge pages in the zygote's memory or a child's (the zygote's
    # PR_SET_THP_DISABLE, kept across fork): khugepaged's collapse of 2 MiB around a few
    # touched pages would be the child's own.
    zygote_status = Path(f"/proc/{zygote.pid}/status").read_text()
    assert "THP_enabled:\t0" in zygote_status
    assert report["thp_enabled"] == "0"


def test_a_child_runs_no_after_fork_hook_and_python_still_works(client: ZygoteClient,
                                                                  tmp_path: Path) -> None:
    # zygote_child.fork: a child skips CPython's after-fork work (each Python call of it
    # a page copied), and threads, logging and signal handlers work in it all the same.
    out = tmp_path / "after_fork.json"
    child = client.spawn(E + "python_after_fork", {"out": str(out)}, vm_id=vid())
    assert client.wait(child.vm_id).exit_code == 0
    report = _read_json(out)
    assert report["hooks_run"] == []
    assert report["seen"] == ["SIGUSR1", "thread 0", "thread 1", "thread 2"]
    assert report["logged"] == [f"logged from pid {report['pid']}"]
    assert report["main"] is True


def test_a_process_with_a_second_thread_is_not_forked_bare() -> None:
    from vmfork import _core
    release = threading.Event()
    thread = threading.Thread(target=release.wait)
    thread.start()
    try:
        with pytest.raises(RuntimeError, match="threads"):
            _core.fork_single_threaded()
    finally:
        release.set()
        thread.join()


def test_the_vmm_nice_value_comes_from_the_zygotes_environment(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(HERE), VMFORK_VMM_NICE="3")
    z = start_zygote(tmp_path / "zygote.sock", env=env, entries_modules=["test_zygote_entries"])
    out = tmp_path / "inspect.json"
    with z.client() as c:
        child = c.spawn(E + "inspect", {"out": str(out)}, vm_id=vid())
        assert c.wait(child.vm_id).exit_code == 0
    assert z.close() == 0
    assert _read_json(out)["nice"] == 3


# Run in a process of its own: is a joined thread's stack still mapped (glibc's cache)?
# The thread is a plain pthread, joined, as the core's threads are (Python's own are
# detached: glibc frees those later, at its next thread's start or exit). Its start
# routine is libc's getpid, which ignores its argument and returns at once.
_STACK_KEPT = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
thread = ctypes.c_ulong()
assert libc.pthread_create(ctypes.byref(thread), None,
                           ctypes.cast(libc.getpid, ctypes.c_void_p), None) == 0
attr = ctypes.create_string_buffer(128)        # a pthread_attr_t is 56 bytes here
assert libc.pthread_getattr_np(thread, attr) == 0
stack, size = ctypes.c_void_p(), ctypes.c_size_t()
assert libc.pthread_attr_getstack(attr, ctypes.byref(stack), ctypes.byref(size)) == 0
libc.pthread_attr_destroy(attr)
assert libc.pthread_join(thread, None) == 0
ranges = [[int(x, 16) for x in line.split()[0].split("-")]
          for line in open("/proc/self/maps")]
print(any(lo <= stack.value < hi for lo, hi in ranges))
"""


def _stack_kept(tunables: str | None) -> bool:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if tunables is not None:
        env["GLIBC_TUNABLES"] = tunables
    out = subprocess.run([sys.executable, "-c", _STACK_KEPT], env=env, check=True,
                         capture_output=True, text=True, timeout=60).stdout
    return out.strip() == "True"


def test_the_zygote_keeps_no_exited_thread_s_stack(zygote: ZygoteProcess) -> None:
    # Its tunables say so, and on this glibc they are what unmaps a joined thread's
    # stack: a process without them keeps it for its next thread.
    environ = dict(entry.split(b"=", 1) for entry in
                   Path(f"/proc/{zygote.pid}/environ").read_bytes().split(b"\0") if entry)
    tunables = environ[b"GLIBC_TUNABLES"].decode()
    assert NO_STACK_CACHE in tunables.split(":")
    assert not _stack_kept(tunables)
    assert _stack_kept(None)


def test_the_stack_cache_tunable_keeps_the_callers_other_tunables() -> None:
    env = with_no_stack_cache({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:"
                                                 "glibc.pthread.stack_cache_size=4096",
                               "HOME": "/h"})
    assert env == {"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{NO_STACK_CACHE}",
                   "HOME": "/h"}
    assert with_no_stack_cache({})["GLIBC_TUNABLES"] == NO_STACK_CACHE


def test_vmms_run_at_nice_10_unless_told() -> None:
    assert _vmm_nice(None) == _vmm_nice("") == 10
    assert _vmm_nice("0") == 0 and _vmm_nice("19") == 19


@pytest.mark.parametrize("value", ["20", "-1", "ten"])
def test_a_vmm_nice_value_out_of_range_is_refused(value: str) -> None:
    with pytest.raises(SystemExit, match="VMFORK_VMM_NICE must be a nice value 0-19"):
        _vmm_nice(value)


def test_children_die_when_the_zygote_is_sigkilled(tmp_path: Path) -> None:
    z = _start(tmp_path)
    with z.client() as c:
        pids = [c.spawn(E + "sleep", vm_id=vid()).pid for _ in range(3)]
        pids += [ch.pid for ch in c.spawn_many(E + "sleep", [SpawnItem(vid()) for _ in
                                                             range(5)]).children]
    assert all(_alive(p) for p in pids)
    os.kill(z.pid, signal.SIGKILL)
    z.proc.wait()
    _until(lambda: not any(_alive(p) for p in pids), 5.0, "children to die with the zygote")
    assert not os.path.exists(tmp_path / "zygote.sock") or True  # stale socket is allowed
    z2 = _start(tmp_path)  # a new zygote replaces the stale socket
    assert z2.close() == 0


def test_a_detached_zygote_outlives_its_starter_and_keeps_children_while_leased(
        tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(HERE))
    z = start_zygote(tmp_path / "zygote.sock", env=env, die_with_parent=False, lease_s=1.0,
                     entries_modules=["test_zygote_entries"])
    try:
        assert os.getsid(z.pid) == z.pid  # its own session: no terminal signal reaches it
        holder = z.client()
        assert holder.lease()["holders"] == 1
        pid = holder.spawn(E + "sleep", vm_id=vid()).pid
        time.sleep(1.5)  # longer than the lease, but the holder is connected
        assert _alive(pid) and z.proc.poll() is None
        holder.close()
        # A new holder within the lease (a restarted daemon) keeps everything alive.
        time.sleep(0.3)
        with z.client() as again:
            again.lease()
            assert [c.pid for c in again.list()] == [pid]
            time.sleep(1.2)
            assert _alive(pid)
        # No holder for longer than the lease: children killed, the zygote exits.
        assert z.proc.wait(10) == 0
        _until(lambda: not _alive(pid), 5.0, "the child to die with its zygote")
        assert not (tmp_path / "zygote.sock").exists()
    finally:
        if z.proc.poll() is None:
            z.proc.kill()
            z.proc.wait()


def test_lease_requests_are_validated(client: ZygoteClient) -> None:
    for bad in (0, -1, "10", True, 10**9):
        with pytest.raises(ZygoteError, match="lease seconds"):
            client.lease(bad)  # type: ignore[arg-type]


def test_killing_a_child_kills_its_grandchildren(client: ZygoteClient, tmp_path: Path) -> None:
    out = tmp_path / "gc.json"
    child = client.spawn(E + "grandchild", {"out": str(out)}, vm_id=vid())
    grandchild = _read_json(out)["grandchild"]
    assert _alive(grandchild)
    client.kill_and_wait(child.vm_id)
    _until(lambda: not _alive(grandchild), 5.0, "the grandchild to die")


def test_a_child_that_exits_takes_its_grandchildren_along(client: ZygoteClient,
                                                          tmp_path: Path) -> None:
    out = tmp_path / "gc.json"
    child = client.spawn(E + "grandchild", {"out": str(out), "exit": True}, vm_id=vid())
    assert client.wait(child.vm_id).exit_code == 0
    grandchild = _read_json(out)["grandchild"]
    _until(lambda: not _alive(grandchild), 5.0, "the orphaned grandchild to be killed")


def test_an_immediate_kill_hits_the_child_not_the_zygote(zygote: ZygoteProcess,
                                                        client: ZygoteClient) -> None:
    # SIGTERM sent right after fork, before the child reset the zygote's handlers.
    for _ in range(10):
        vm_ids = [vid("q") for _ in range(10)]
        client.spawn_many(E + "sleep", [SpawnItem(v) for v in vm_ids])
        for vm_id in vm_ids:
            client.kill(vm_id, signal.SIGTERM)
        events = [client.wait(vm_id) for vm_id in vm_ids]
        assert {(e.reason, e.signal) for e in events} == {("killed", signal.SIGTERM)}
    assert client.ping()["pid"] == zygote.pid and zygote.proc.poll() is None


def test_run_dir_is_removed_after_exit(client: ZygoteClient, tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "vm-a"
    log = tmp_path / "a.log"
    child = client.spawn(E + "fill_run_dir", {"run_dir": str(run_dir), "log_path": str(log)},
                         vm_id=vid())
    _until(lambda: (run_dir / "vm.sock").exists(), what="the entry to fill its run_dir")
    event = client.kill_and_wait(child.vm_id)
    assert not run_dir.exists() and event.cleanup_errors == []
    assert log.exists()  # the log lives outside run_dir and is kept


def test_spawn_many_runs_50_children_in_parallel(client: ZygoteClient, tmp_path: Path) -> None:
    items = [SpawnItem(vid("m"), {"seconds": 1.0, "out": str(tmp_path / f"{i}.json")})
             for i in range(50)]
    t0 = time.monotonic()
    result = client.spawn_many(E + "sleep", items)
    assert result.failed == []
    assert len({c.pid for c in result.children}) == 50
    events = [client.wait(c.vm_id) for c in result.children]
    elapsed = time.monotonic() - t0
    assert all(e.reason == "exited" and e.exit_code == 0 for e in events)
    # 50 one-second sleeps in sequence would take 50 s; in parallel about 1 s.
    assert elapsed < 10, f"50 children took {elapsed:.1f} s: they did not run in parallel"
    assert len(list(tmp_path.glob("*.json"))) == 50


def test_spawn_many_reports_bad_items_and_forks_the_rest(client: ZygoteClient) -> None:
    good = vid()
    result = client.spawn_many(E + "exit_with", [SpawnItem(good, {"code": 0}),
                                                 SpawnItem("bad/id"), SpawnItem(good)])
    assert [c.vm_id for c in result.children] == [good]
    assert [vm for vm, _ in result.failed] == ["bad/id", good]
    assert client.wait(good).exit_code == 0


# -- cgroups --------------------------------------------------------------------------


@needs_cgroup
def test_child_joins_its_cgroup_with_the_limit(client: ZygoteClient, tmp_path: Path) -> None:
    h = cgroups.detect()
    assert h is not None
    out = tmp_path / "inspect.json"
    child = client.spawn(E + "inspect", {"out": str(out), "linger": 3600}, vm_id=vid(),
                         memory_limit_mib=96, cgroup_parent=CG_PARENT)
    assert child.cgroup == f"/{CG_PARENT}/{child.vm_id}"
    report = _read_json(out)
    limit = int((h.root / CG_PARENT / child.vm_id / h.limit_file).read_text())
    client.kill_and_wait(child.vm_id)
    assert limit == 96 << 20
    assert report["ctx"]["cgroup"] == child.cgroup
    memory_line = [ln for ln in report["cgroup"].splitlines()
                   if (h.version == 1 and ":memory:" in ln) or (h.version == 2 and
                                                                ln.startswith("0::"))]
    assert memory_line[0].endswith(child.cgroup)
    assert child.vm_id not in cgroups.list_groups(h, CG_PARENT)


@needs_cgroup
def test_a_refused_jail_leaves_no_cgroup_and_no_run_dir(client: ZygoteClient,
                                                       tmp_path: Path) -> None:
    """A spawn whose jail is refused, in its checks (a root uid) or in its plan (a
    namespace name no sandbox has), leaves neither its cgroup nor the run directory it
    made, and leaves alone one that was there before."""
    h = cgroups.detect()
    assert h is not None
    refused = (({"uid": 0, "gid": 0}, {}, "never runs as root"),
               ({"uid_range": [1_000_000, 8]}, {"netns": "no such ns"}, "network namespace"))
    for jail, extra, reason in refused:
        vm_id = vid()
        run_dir = tmp_path / vm_id
        with pytest.raises(ZygoteError, match=reason):
            client.spawn(E + "inspect", {"out": str(tmp_path / "x.json"),
                                         "run_dir": str(run_dir), **extra},
                         vm_id=vm_id, memory_limit_mib=64, cgroup_parent=CG_PARENT, jail=jail)
        assert not run_dir.exists()
        assert vm_id not in cgroups.list_groups(h, CG_PARENT)
    # A run directory that was there before the spawn is not the spawn's to remove.
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "mine").write_text("x")
    with pytest.raises(ZygoteError, match="network namespace"):
        client.spawn(E + "inspect", {"out": str(tmp_path / "x.json"), "run_dir": str(kept),
                                     "netns": "no such ns"}, vm_id=vid(), memory_limit_mib=64,
                     cgroup_parent=CG_PARENT, jail={"uid_range": [1_000_000, 8]})
    assert (kept / "mine").read_text() == "x"


@needs_cgroup
def test_oom_kill_is_reported_as_oom_killed(client: ZygoteClient, tmp_path: Path) -> None:
    out = tmp_path / "alloc.json"
    child = client.spawn(E + "allocate", {"mib": 256, "out": str(out)}, vm_id=vid(),
                         memory_limit_mib=64, cgroup_parent=CG_PARENT)
    event = client.wait(child.vm_id, timeout=60)
    assert event.reason == "oom-killed", event
    assert event.signal == signal.SIGKILL and not event.kill_requested
    assert event.oom_kills is None or event.oom_kills >= 1
    assert not out.exists()
    # The same allocation without a limit succeeds: the limit, not the entry, killed it.
    free = client.spawn(E + "allocate", {"mib": 256, "out": str(out)}, vm_id=vid())
    assert client.wait(free.vm_id, timeout=60).exit_code == 0


@needs_cgroup
def test_killed_child_in_a_cgroup_is_killed_not_oom(client: ZygoteClient) -> None:
    child = client.spawn(E + "sleep", vm_id=vid(), memory_limit_mib=64,
                         cgroup_parent=CG_PARENT)
    event = client.kill_and_wait(child.vm_id)
    assert (event.reason, event.oom_kills) == ("killed", 0)


# -- leaks ----------------------------------------------------------------------------


def test_no_leaks_over_200_spawn_kill_cycles(zygote: ZygoteProcess, client: ZygoteClient,
                                             tmp_path: Path) -> None:
    use_cg = os.geteuid() == 0 and cgroups.detect() is not None
    run_root = tmp_path / "run"
    run_root.mkdir()
    logs = tmp_path / "logs"
    logs.mkdir()

    def snap() -> Any:
        return leak_snapshot(zygote.pid, cgroup_parent=CG_PARENT, run_root=run_root)

    client.ping()  # this test's connection is open before the baseline is taken
    before = snap()
    assert before.children == ()
    for i in range(200):
        vm_id = vid("leak")
        args = {"run_dir": str(run_root / vm_id), "log_path": str(logs / f"{vm_id}.log"),
                "seconds": 3600}
        limit = 64 if use_cg and i % 2 == 0 else None
        child = client.spawn(E + "fill_run_dir", args, vm_id=vm_id, memory_limit_mib=limit,
                             cgroup_parent=CG_PARENT)
        if i % 3 == 0:  # sometimes kill it mid-setup, sometimes once it is running
            log = logs / f"{vm_id}.log"
            _until(lambda log=log: log.exists() and log.stat().st_size > 0,  # type: ignore[misc]
                   what="entry running")
        during = snap()
        assert during.children == (child.pid,)
        if limit:
            assert during.cgroup_dirs == (vm_id,)
        event = client.kill_and_wait(vm_id)
        assert event.cleanup_errors == []
    after = snap()
    assert after == before, f"leaked: before {before}, after {after}"
    assert child_pids(zygote.pid) == ()


@pytest.fixture
def counted_resolve(monkeypatch: pytest.MonkeyPatch
                    ) -> tuple[Callable[[object], Any], list[object]]:
    """The zygote's ``_resolve_jail`` on a fresh cache, and the requests it resolved
    (``_jail_request``'s calls) so far."""
    from vmfork.runtime import zygote as zygote_module
    resolved: list[object] = []
    real = zygote_module._jail_request

    def counted(value: object, shared: Any) -> Any:
        resolved.append(value)
        return real(value, shared)

    monkeypatch.setattr(zygote_module, "_jail_request", counted)
    holder = SimpleNamespace(_jail_requests=OrderedDict(), _shared_tree=None)

    def resolve(value: object) -> Any:
        return zygote_module.Zygote._resolve_jail(holder, value)  # type: ignore[arg-type]

    return resolve, resolved


def test_a_jail_request_is_resolved_once_for_the_spawns_that_ask_it(
        counted_resolve: tuple[Callable[[object], Any], list[object]]) -> None:
    from vmfork.runtime import zygote as zygote_module
    resolve, resolved = counted_resolve

    def ask(uid: int) -> dict[str, Any]:
        return {"uid": uid, "gid": uid, "read_only": ["/srv/a"], "devices": ["/dev/kvm"]}

    first = resolve(ask(5))
    assert resolve({"devices": ["/dev/kvm"], "read_only": ["/srv/a"], "gid": 5, "uid": 5}) \
        is first and len(resolved) == 1                  # the same request, in any order
    assert first.spec.uid == 5 and resolve(None) is None
    others = [resolve(ask(uid)) for uid in range(6, 6 + zygote_module.JAIL_REQUESTS_KEPT - 1)]
    assert resolve(ask(5)) is first                      # used again: the newest now
    resolve(ask(100))                                    # one more: uid 6's goes
    assert len(resolved) == zygote_module.JAIL_REQUESTS_KEPT + 1
    assert resolve(ask(5)) is first and resolve(ask(7)) is others[1]
    assert resolve(ask(6)) is not others[0] and len(resolved) == zygote_module.JAIL_REQUESTS_KEPT + 2
    with pytest.raises(zygote_module.RequestError, match="never runs as root"):
        resolve(ask(0))


def test_a_spawns_own_files_leave_its_jail_request_resolved_once(
        counted_resolve: tuple[Callable[[object], Any], list[object]]) -> None:
    """Each spawn of a snapshot asks its jail with FIFOs of its own, below ``runs_in``:
    they are not part of what the zygote resolves once, and each spawn's jail still
    binds its own."""
    from vmfork.runtime import zygote as zygote_module
    resolve, resolved = counted_resolve

    def ask(token: str, runs_in: str = "/run/vmfork/run") -> dict[str, Any]:
        return {"uid_range": [100000, 8], "devices": ["/dev/kvm"], "runs_in": runs_in,
                "read_only": ["/srv/snap/state.bin", f"/run/vmfork/run/b-{token}/.notify-{token}",
                              f"/run/vmfork/run/b-{token}/.start-{token}"]}

    first, second = resolve(ask("a")), resolve(ask("b"))
    assert len(resolved) == 1 and first.spec is second.spec
    assert first.spec.read_only[-1] == "/srv/snap/state.bin"
    assert first.spawn_files == ("/run/vmfork/run/b-a/.notify-a", "/run/vmfork/run/b-a/.start-a")
    spec = zygote_module._jail_spec(second, "/run/vmfork/run/b-b/vm-1", set(), {})
    assert spec is not None
    assert spec.read_only[-3:] == ("/srv/snap/state.bin", "/run/vmfork/run/b-b/.notify-b",
                                   "/run/vmfork/run/b-b/.start-b")
    # Not below runs_in (or no runs_in): part of the request, as any read-only path.
    outside = resolve(ask("c", runs_in="/elsewhere"))
    assert outside.spawn_files == () and "/run/vmfork/run/b-c/.notify-c" in outside.spec.read_only
    assert len(resolved) == 2
    # A spawn's own path is checked as every read-only path is.
    bad = ask("d")
    bad["read_only"].append("/run/vmfork/run/b-d/../../../../etc/shadow")
    with pytest.raises(zygote_module.RequestError, match="absolute paths"):
        resolve(bad)
