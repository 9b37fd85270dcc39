"""Where commands run, the native path, the QEMU command line, PVH kernel extraction."""

from __future__ import annotations

import lzma
import struct
import sys
from pathlib import Path

import pytest

from vmfork import testhost
from vmfork.testhost import (
    TesthostSetupError,
    TesthostTimeout,
    needs_emulation,
    run_in_testhost,
)
from vmfork.testhost.initramfs import HostImage
from vmfork.testhost.kernel_image import has_pvh_entry, pvh_elf_from_bzimage
from vmfork.testhost.qemu import _diagnose, _without_tcg_warnings, qemu_command


@pytest.fixture
def probe_says(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    answer = [False]
    monkeypatch.setattr(testhost, "_native_kvm_runs_guests", lambda: answer[0])
    return answer


def test_mode_decision(probe_says: list[bool]) -> None:
    assert needs_emulation(environ={}) is True
    probe_says[0] = True
    assert needs_emulation(environ={}) is False
    assert needs_emulation(environ={"VMFORK_TESTHOST": "always"}) is True
    probe_says[0] = False
    assert needs_emulation(environ={"VMFORK_TESTHOST": "never"}) is False
    assert needs_emulation("never", environ={"VMFORK_TESTHOST": "always"}) is False
    # inside the test host, always run directly
    assert needs_emulation("always", environ={"VMFORK_IN_TESTHOST": "1"}) is False
    with pytest.raises(TesthostSetupError, match="VMFORK_TESTHOST='sometimes'"):
        needs_emulation(environ={"VMFORK_TESTHOST": "sometimes"})


def test_missing_probe_means_emulate(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_probe(name: str) -> object:
        raise ImportError(name)
    monkeypatch.setattr(testhost.importlib, "import_module", no_probe)
    monkeypatch.setattr(testhost, "_boot_id", lambda: "")
    assert testhost._native_kvm_runs_guests() is False


def test_native_run_passes_status_env_and_cwd(tmp_path: Path) -> None:
    script = ("import os, sys; open('out', 'w').write(os.environ['X'] + os.getcwd()); "
              "sys.exit(7)")
    status = run_in_testhost([sys.executable, "-c", script], mode="never", cwd=str(tmp_path),
                             pass_env=["X=hello"])
    assert status == 7
    assert (tmp_path / "out").read_text() == "hello" + str(tmp_path.resolve())


def test_native_run_reports_signals_and_missing_commands(tmp_path: Path) -> None:
    kill_self = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    assert run_in_testhost([sys.executable, "-c", kill_self], mode="never") == 128 + 9
    assert run_in_testhost([str(tmp_path / "nope")], mode="never") == 127


def test_native_timeout() -> None:
    with pytest.raises(TesthostTimeout) as caught:
        run_in_testhost([sys.executable, "-c", "import time; time.sleep(30)"], mode="never",
                        timeout=0.5)
    assert caught.value.status == 124


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        run_in_testhost([], mode="never")
    with pytest.raises(ValueError):
        run_in_testhost(["true"], mode="never", cgroup="v3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a valid variable name"):
        run_in_testhost(["true"], mode="never", pass_env=["1=2"])


def test_qemu_command_line() -> None:
    image = HostImage("6.1.0-57-amd64", Path("/c/kernel"), Path("/c/initramfs.cpio"), (), False)
    cmd = qemu_command("/usr/bin/qemu-system-x86_64", image, ctl_dir="/run/x,y",
                       rw_paths=["/work/main", "/tmp/a"], mem_mib=2048, cpus=3,
                       console_fd=4, stdout_fd=6, stderr_fd=8)
    joined = " ".join(cmd)
    assert cmd[0] == "/usr/bin/qemu-system-x86_64"
    for flag in ("-M q35", "-accel tcg,thread=multi", "-smp 3", "-cpu EPYC,+svm", "-m 2048",
                 "-nodefaults", "-no-user-config", "-no-reboot", "-kernel /c/kernel",
                 "-initrd /c/initramfs.cpio"):
        assert flag in joined, flag
    virtfs = [cmd[i + 1] for i, word in enumerate(cmd) if word == "-virtfs"]
    assert virtfs[0] == ("local,path=/,mount_tag=host,security_model=none,readonly=on,"
                         "multidevs=remap")
    assert virtfs[1] == "local,path=/run/x,,y,mount_tag=vmfork_ctl,security_model=none"
    assert virtfs[2].startswith("local,path=/work/main,mount_tag=rw0,")
    assert virtfs[3].startswith("local,path=/tmp/a,mount_tag=rw1,")
    assert "readonly" not in virtfs[2]
    assert "path=/proc/self/fd/6" in joined and "name=stdout" in joined
    assert "path=/proc/self/fd/8" in joined and "name=stderr" in joined


def test_diagnosis_names_the_cause() -> None:
    panic = "[ 4.3] Kernel panic - not syncing: sysrq triggered crash\n[ 4.3] stack"
    assert "kernel panicked: [ 4.3] Kernel panic" in _diagnose(None, panic, "")
    init = "vmfork-testhost init: mount 9p share host on /lower (ro)\n"
    assert _diagnose(0, init, "") == "the test host's /init failed: mount 9p share host on " \
                                     "/lower (ro)"
    assert _diagnose(1, "", "qemu: cannot set up guest memory\n") == \
        "QEMU exited with status 1: qemu: cannot set up guest memory"
    assert "without reporting an exit status" in _diagnose(0, "", "")
    noisy = "qemu: warning: TCG doesn't support requested feature: x\nreal error\n"
    assert _without_tcg_warnings(noisy) == "real error\n"


def _elf_with_notes(notes: list[tuple[bytes, int]]) -> bytes:
    """A minimal ELF64 with one PT_NOTE segment holding ``notes``."""
    blob = b""
    for name, n_type in notes:
        name0 = name + b"\0"
        desc = b"\0" * 8
        blob += struct.pack("<III", len(name0), len(desc), n_type)
        blob += name0 + b"\0" * (-len(name0) % 4) + desc
    phoff, note_off = 64, 64 + 56
    header = b"\x7fELF" + bytes([2, 1, 1]) + b"\0" * 9
    header += struct.pack("<HHIQQQIHHHHHH", 2, 62, 1, 0x1000000, phoff, 0, 0, 64, 56, 1, 64,
                          0, 0)
    phdr = struct.pack("<IIQQQQQQ", 4, 4, note_off, 0, 0, len(blob), len(blob), 4)
    return header + phdr + blob


def _bzimage(payload: bytes, version: int = 0x20F) -> bytes:
    setup_sects = 1
    image = bytearray((setup_sects + 1) * 512)
    image[0x1F1] = setup_sects
    image[0x202:0x206] = b"HdrS"
    struct.pack_into("<H", image, 0x206, version)
    struct.pack_into("<II", image, 0x248, 16, len(payload))
    return bytes(image) + b"\0" * 16 + payload + b"trailing"


def test_pvh_elf_is_extracted_from_an_xz_bzimage() -> None:
    elf = _elf_with_notes([(b"Xen", 6), (b"Xen", 18)])
    assert has_pvh_entry(elf)
    packed = lzma.compress(elf, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC32)
    assert pvh_elf_from_bzimage(_bzimage(packed)) == elf


def test_no_pvh_note_or_old_protocol_falls_back() -> None:
    plain = _elf_with_notes([(b"Xen", 6), (b"GNU", 18)])
    assert not has_pvh_entry(plain)
    packed = lzma.compress(plain, format=lzma.FORMAT_XZ)
    assert pvh_elf_from_bzimage(_bzimage(packed)) is None
    good = lzma.compress(_elf_with_notes([(b"Xen", 18)]), format=lzma.FORMAT_XZ)
    assert pvh_elf_from_bzimage(_bzimage(good, version=0x207)) is None
    assert pvh_elf_from_bzimage(_bzimage(b"\x28\xb5\x2f\xfdzstd")) is None
    assert pvh_elf_from_bzimage(b"not a kernel") is None


@pytest.mark.skipif(not any(Path("/boot").glob("vmlinuz-*")), reason="no installed kernel")
def test_the_installed_debian_kernel_boots_by_pvh() -> None:
    vmlinuz = max(Path("/boot").glob("vmlinuz-*"))
    try:
        data = vmlinuz.read_bytes()
    except PermissionError:
        pytest.skip(f"{vmlinuz} is not readable")
    elf = pvh_elf_from_bzimage(data)
    assert elf is not None and elf[:4] == b"\x7fELF"


def _debian_kernel_installed() -> bool:
    try:
        from vmfork.testhost.modules import find_kernel, wanted_modules
        find_kernel(wanted_modules())
    except TesthostSetupError:
        return False
    return Path("/bin/busybox").exists()


@pytest.mark.skipif(not _debian_kernel_installed(),
                    reason="needs linux-image-amd64 and busybox-static")
def test_host_image_is_built_once_and_holds_what_init_needs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import stat

    from vmfork.image.cpio import read_cpio
    from vmfork.testhost.initramfs import host_image

    monkeypatch.setenv("VMFORK_CACHE_DIR", str(tmp_path))
    try:
        image = host_image()
    except TesthostSetupError as err:
        pytest.skip(str(err))
    assert image.built_now
    entries = {e.path: e for e in read_cpio(image.initramfs.read_bytes())}
    assert stat.S_ISCHR(entries["dev/console"].mode)
    assert entries["bin/sh"].data == b"busybox"
    init = entries["init"].data.decode()
    assert f"for module in {' '.join(image.modules)}; do" in init
    for name in image.modules:
        assert entries[f"lib/modules/{name}.ko"].data[:4] == b"\x7fELF"
    assert image.modules.index("kvm") < image.modules.index("kvm_amd")
    again = host_image()
    assert (again.initramfs, again.built_now) == (image.initramfs, False)


def test_heartbeats_are_seen_when_the_console_trickles_in_byte_by_byte() -> None:
    import os
    import time

    from vmfork.testhost import qemu

    read_end, write_end = os.pipe()
    console = qemu._Relay(read_end, None, keep_tail=True)
    console.start()
    try:
        for byte in f"[ 1.0] boot\n{qemu.HEARTBEAT_PREFIX} uptime=1.0\n".encode():
            os.write(write_end, bytes([byte]))
            time.sleep(0.001)  # each byte its own read, as QEMU's UART delivers them
        deadline = time.monotonic() + 5
        while console.last_heartbeat is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert console.last_heartbeat is not None
        seen = console.last_heartbeat
        os.write(write_end, b"no heartbeat here, only heartbeat-like words\n")
        time.sleep(0.2)
        assert console.last_heartbeat == seen
    finally:
        os.close(write_end)
        console.join(5)


def _supervised(monkeypatch: pytest.MonkeyPatch, beats: int, lost_after: float,
                timeout: float | None,
                boot_limit: float = 300.0) -> tuple[BaseException | int, float]:
    """Supervise a real `sleep 30` whose console pipe carries `beats` heartbeats, then silence."""
    import os
    import subprocess
    import time

    from vmfork.testhost import qemu

    monkeypatch.setattr(qemu, "HEARTBEAT_LOST_SECONDS", lost_after)
    monkeypatch.setattr(qemu, "BOOT_SECONDS_LIMIT", boot_limit)
    read_end, write_end = os.pipe()
    console = qemu._Relay(read_end, None, keep_tail=True)
    console.start()
    for _ in range(beats):
        os.write(write_end, f"{qemu.HEARTBEAT_PREFIX} uptime=1.0\n".encode())
    time.sleep(0.2)
    proc = subprocess.Popen(["sleep", "30"])
    started = time.monotonic()
    try:
        outcome: BaseException | int = qemu._supervise(proc, [console], started, timeout)
    except Exception as err:  # noqa: BLE001 - the outcome under test
        outcome = err
    finally:
        os.close(write_end)
        proc.kill()
        proc.wait()
    return outcome, time.monotonic() - started


def test_a_silent_test_host_is_killed_as_hung(monkeypatch: pytest.MonkeyPatch) -> None:
    from vmfork.testhost.errors import TesthostBootError

    outcome, took = _supervised(monkeypatch, beats=1, lost_after=1.0, timeout=60)
    assert isinstance(outcome, TesthostBootError), outcome
    assert "no heartbeat" in str(outcome) and "heartbeat uptime=1.0" in outcome.console_tail
    assert took < 20


def test_before_the_first_heartbeat_the_boot_limit_applies(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from vmfork.testhost.errors import TesthostBootError

    # Booting: heartbeat silence alone means nothing; a boot that never starts the
    # command is a failed host once the boot limit passes...
    outcome, took = _supervised(monkeypatch, beats=0, lost_after=0.5, timeout=60,
                                boot_limit=2.0)
    assert isinstance(outcome, TesthostBootError), outcome
    assert "did not start the command" in str(outcome)
    assert 1.5 < took < 20
    # ... unless the timeout comes first.
    outcome, took = _supervised(monkeypatch, beats=0, lost_after=0.5, timeout=2,
                                boot_limit=60.0)
    assert isinstance(outcome, TesthostTimeout), outcome
    assert 1.5 < took < 20


KALLSYMS = """\
ffffffff81000000 T startup_64
ffffffff81001000 T native_safe_halt
ffffffff81001080 t default_idle
ffffffff81a59180 T __svm_vcpu_run [kvm_amd]
"""

REGISTERS = """\
CPU#0
RAX=ffffffff81a59180 RBX=0000000000000000 RCX=0000000000000020 RDX=4000000000000000
RIP=ffffffff81001084 RFL=00000216 [----AP-] CPL=0 II=0 A20=1 SMM=0 HLT=1
EFER=0000000000001d01
CPU#1
RAX=0000000000000000 RBX=0000000000000000 RCX=0000000000000000 RDX=0000000000000000
RIP=ffffffff81a5929c RFL=00000246 [---Z-P-] CPL=0 II=0 A20=1 SMM=0 HLT=0
EFER=0000000000000d01
"""


def test_monitor_registers_are_read_per_cpu_and_named_from_kallsyms() -> None:
    from vmfork.testhost import monitor

    # CPU 1's EFER has no SVME: it is running a nested guest.
    where = monitor.instruction_pointers(REGISTERS)
    assert where == {0: (0xFFFFFFFF81001084, False), 1: (0xFFFFFFFF81A5929C, True)}
    symbols = monitor.Symbols(KALLSYMS)
    assert symbols.name(where[0][0]) == "default_idle+0x4"
    assert symbols.name(where[1][0]) == "__svm_vcpu_run+0x11c [kvm_amd]"
    assert symbols.name(0x5573EE84E1B6) is None  # below the kernel: user space


def test_kernel_symbols_are_cached_per_version_and_never_outside_the_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vmfork.testhost import monitor

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("VMFORK_CACHE_DIR", raising=False)
    dump = tmp_path / "kallsyms"
    monitor.keep_symbols("6.1.0-test", dump)  # absent: nothing cached
    assert monitor.Symbols.load("6.1.0-test") is None
    dump.write_text("")
    monitor.keep_symbols("6.1.0-test", dump)  # empty: nothing cached
    assert monitor.Symbols.load("6.1.0-test") is None
    dump.write_text(KALLSYMS)
    fresh = monitor.Symbols.load("6.1.0-test", dump)  # this run's dump, before caching
    assert fresh is not None and fresh.name(0xFFFFFFFF81001001) == "native_safe_halt+0x1"
    monitor.keep_symbols("6.1.0-test", dump)
    cached = monitor.Symbols.load("6.1.0-test")
    assert cached is not None and cached.name(0xFFFFFFFF81000010) == "startup_64+0x10"
    for bad in ("", "../etc", "a/b", ".hidden"):
        with pytest.raises(ValueError):
            monitor.symbols_path(bad)


def test_stale_run_directories_of_dead_owners_are_swept(tmp_path: Path) -> None:
    import os
    import subprocess
    import time

    from vmfork.testhost.qemu import LEGACY_RUN_AGE_S, OWNER_FILE, sweep_stale_runs

    dead = subprocess.Popen(["true"])
    dead.wait()

    def run(name: str, owner: int | None, age_s: float = 0.0) -> Path:
        d = tmp_path / f"testhost-{name}"
        d.mkdir()
        (d / "job.sh").write_text("true\n")
        (tmp_path / f"testhost-{name}.monitor").touch()
        if owner is not None:
            (d / OWNER_FILE).write_text(f"{owner}\n")
        stamp = time.time() - age_s
        os.utime(d, (stamp, stamp))
        return d

    run("gone", dead.pid)
    run("mine", os.getpid())
    run("oldlegacy", None, LEGACY_RUN_AGE_S + 60)
    run("newlegacy", None)
    (tmp_path / "testhost-native-kvm-boot").mkdir()
    assert sweep_stale_runs(tmp_path) == ["testhost-gone", "testhost-oldlegacy"]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["testhost-mine", "testhost-mine.monitor", "testhost-native-kvm-boot",
                    "testhost-newlegacy", "testhost-newlegacy.monitor"]
