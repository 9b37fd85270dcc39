"""Memory phases and the Private_Dirty breakdown by mapping (``runtime/memphases.py``):
the classifier on a hand-made smaps and on this process's own, and real zygote
children (one jailed) that record their phases when the zygote is asked to."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from vmfork.runtime import jail, memphases
from vmfork.runtime.zygote_client import ZygoteProcess, start_zygote

HERE = Path(__file__).resolve().parent
E = "test_zygote_entries:"


def _mapping(start: int, end: int, perms: str, path: str, dirty_kib: int) -> str:
    return (f"{start:08x}-{end:08x} {perms} 00000000 00:00 0          {path}\n"
            f"Size:           {(end - start) // 1024} kB\n"
            f"Private_Dirty:  {dirty_kib} kB\nVmFlags: rd wr\n")


SMAPS = "".join([
    _mapping(0x400000, 0x401000, "r-xp", "/usr/bin/python3.11", 0),
    _mapping(0x01000000, 0x02000000, "rw-p", "[heap]", 300),
    _mapping(0x10000000, 0x10001000, "---p", "", 0),              # a thread's guard page
    _mapping(0x10001000, 0x10801000, "rw-p", "", 40),             # ... and its stack
    _mapping(0x20000000, 0x20100000, "rw-p", "", 500),            # pymalloc arenas
    _mapping(0x30000000, 0x31000000, "rw-p", "/snap/memory.bin", 9000),
    _mapping(0x40000000, 0x40100000, "r-xp", "/lib/libpython3.11.so.1.0", 0),
    _mapping(0x40100000, 0x40180000, "rw-p", "/lib/libpython3.11.so.1.0", 200),
    _mapping(0x40180000, 0x40190000, "rw-p", "", 60),             # libpython's bss
    _mapping(0x50000000, 0x50010000, "rw-p", "/x/vmfork/_core.abi3.so", 30),
    _mapping(0x50010000, 0x50011000, "rw-p", "", 4),              # _core's bss
    _mapping(0x60000000, 0x60010000, "rw-p", "/lib/x86_64-linux-gnu/libc.so.6", 16),
    _mapping(0x60010000, 0x60210000, "rw-p", "", 700),            # libc's bss + heap, merged
    _mapping(0x70000000, 0x70021000, "rw-p", "[stack]", 24),
    _mapping(0x80000000, 0x80002000, "r--p", "[vvar]", 0),
    _mapping(0x90000000, 0x90001000, "rw-p", "/tmp/some.log", 4),
    _mapping(0xA4000000, 0xA4021000, "rw-p", "", 132),            # a thread's malloc arena
    _mapping(0xA4021000, 0xA8000000, "---p", "", 0),              # ... and its reserve
    _mapping(0xAC000000, 0xB0000000, "rw-p", "", 8),              # an arena grown in full
    _mapping(0xB4000000, 0xB4100000, "rw-p", "", 12),             # aligned, but no arena
    _mapping(0xC0001000, 0xC3001000, "rw-p", "", 96),             # a native child's heap
    _mapping(0xC3001000, 0xC3002000, "---p", "", 0),              # ... its upper guard
    _mapping(0xC3002000, 0xC3202000, "rw-p", "", 50),             # pymalloc arenas above it
    _mapping(0xD0000000, 0xD0100000, "rw-p", "[anon:vmfork-child-heap]", 8),  # ... named
    _mapping(0xD0100000, 0xD0102000, "---p", "", 0),              # its guard + a stack's
    _mapping(0xD0102000, 0xD0902000, "rw-p", "", 20),             # ... that stack
])


def test_each_mapping_lands_in_its_class(monkeypatch: pytest.MonkeyPatch) -> None:
    # What the ELF headers of these (made-up) objects would say their bss is.
    for path, size in (("/lib/libpython3.11.so.1.0", 64 << 10),
                       ("/x/vmfork/_core.abi3.so", 4 << 10),
                       ("/lib/x86_64-linux-gnu/libc.so.6", 64 << 10)):
        monkeypatch.setitem(memphases._bss_sizes, path, size)
    classes = memphases.classify(SMAPS.encode(), memphases.guest_ram_paths(["/snap/memory.bin"]))
    assert classes == {"python_heap_anon": 1262, "malloc_arenas": 140, "brk_heap": 300,
                       "child_heap": 104, "thread_stacks": 60, "main_stack": 24,
                       "python_binary": 260, "core_so": 34, "other_libraries": 16,
                       "guest_ram": 9000, "other": 4}
    assert memphases.own_private_dirty(classes) == 2204


def test_the_child_heap_size_is_the_core_s() -> None:
    from vmfork import _core
    assert memphases.CHILD_HEAP_BYTES == _core.CHILD_HEAP_BYTES


def test_guest_ram_is_found_behind_another_namespace_s_root() -> None:
    """A snapshot's RAM the zygote mapped in its own mount namespace is named from that
    namespace's root when the reader is chrooted (the test host's /newroot)."""
    is_ram = memphases.guest_ram_paths(["/snap/memory.bin"])
    assert is_ram(1 << 20, "/snap/memory.bin")
    assert is_ram(1 << 20, "/newroot/snap/memory.bin")
    assert not is_ram(1 << 20, "/snap/memory.bin.old")
    assert not is_ram(1 << 20, "/other/xsnap/memory.bin")


def test_the_bss_of_a_real_object_is_read_from_its_elf_headers() -> None:
    import vmfork._core
    assert memphases.bss_bytes(vmfork._core.__file__) % memphases.PAGE == 0
    libc = next(line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                if "/libc.so" in line)
    assert memphases.bss_bytes(libc) > 0
    assert memphases.bss_bytes("/nonexistent.so") == 0
    assert memphases.bss_bytes(__file__) == 0     # not an ELF


def test_every_page_of_a_real_process_is_counted_once() -> None:
    with memphases.read_smaps() as view:
        smaps = bytes(view)
    total = sum(int(line.split()[1]) for line in smaps.splitlines()
                if line.startswith(b"Private_Dirty:"))
    classes = memphases.classify(smaps, lambda size, path: False)
    assert sum(classes.values()) == total > 0
    assert classes["python_binary"] + classes["other_libraries"] > 0
    assert classes["guest_ram"] == 0


def test_without_the_setting_nothing_is_recorded(tmp_path: Path) -> None:
    assert memphases.IDLE_S is None    # the test process has no VMFORK_MEMORY_PHASES
    memphases.record("anything", str(tmp_path))
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def base() -> Iterator[Path]:
    # Outside pytest's tmp_path, as in test_jail: a jail must not hold the whole tree.
    root = Path(tempfile.mkdtemp(prefix="vmfm-", dir="/tmp"))
    root.chmod(0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def zygote(base: Path) -> Iterator[ZygoteProcess]:
    env = dict(os.environ, PYTHONPATH=str(HERE), **{memphases.ENV: "0"})
    z = start_zygote(base / "zygote.sock", env=env, entries_modules=["test_zygote_entries"])
    yield z
    z.close()


def _phases_of(zygote: ZygoteProcess, run_dir: Path, jail_spec: object,
               expected: list[str]) -> list[dict[str, object]]:
    client = zygote.client()
    child = client.spawn(E + "record_phase", {"run_dir": str(run_dir)},
                         vm_id="m-" + uuid.uuid4().hex[:10], jail=jail_spec)
    try:
        deadline = time.monotonic() + 20
        while len(phases := memphases.read_phases(str(run_dir))) < len(expected):
            assert time.monotonic() < deadline, f"phases so far: {phases}"
            time.sleep(0.05)
    finally:
        client.kill(child.vm_id)
        client.wait(child.vm_id)
    return phases


def test_a_child_records_its_phases_when_the_zygote_is_asked_to(
        zygote: ZygoteProcess, base: Path) -> None:
    phases = _phases_of(zygote, base / "plain", None, ["forked", "set_up", "entry"])
    assert [p["phase"] for p in phases] == ["forked", "set_up", "entry"]
    for p in phases:
        classes = p["classes_kib"]
        assert isinstance(classes, dict) and set(classes) == set(memphases.CLASSES)
        assert p["own_private_dirty_kib"] == sum(classes.values())


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/kvm")
                    or bool(jail.problems()),
                    reason="needs root, /dev/kvm and a host that can build a jail")
def test_a_jailed_child_goes_on_recording_after_its_uid_changed(
        zygote: ZygoteProcess, base: Path) -> None:
    jail_spec = {"uid": 71101, "gid": 71101, "read_only": [], "devices": ["/dev/kvm"]}
    phases = _phases_of(zygote, base / "jailed", jail_spec,
                        ["forked", "set_up", "jailed", "entry"])
    assert [p["phase"] for p in phases] == ["forked", "set_up", "jailed", "entry"]
