"""The parent VMM of ``vmfork snapshot`` runs jailed (docs/security.md, issue 16): a uid
of its own, no capabilities, ``NO_NEW_PRIVS``, its seccomp filter and a root holding
only what it needs, from before the guest runs to the end of its warm-up; its snapshot
is taken into the store by the unjailed side, and a failure registers nothing."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from vmfork.runtime.parent import PARENT_UID_RANGE, ParentFailed, ParentRequest, boot_parent
from vmfork.store import Store

pytestmark = pytest.mark.e2e

WARM_S = 20


def _status(pid: int) -> dict[str, str] | None:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return {k: v.strip() for k, v in (line.split(":", 1) for line in text.splitlines()
                                      if ":" in line)}


def _parent_vmms() -> list[int]:
    first, count = PARENT_UID_RANGE
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _status(int(name))
            if st is not None and first <= int(st["Uid"].split()[0]) < first + count:
                found.append(int(name))
    return found


def test_the_parent_vmm_is_jailed_while_its_warm_up_runs(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "store")
    outcome: dict[str, object] = {}

    def make() -> None:
        try:
            outcome["result"] = boot_parent(ParentRequest(
                tag="jailed", mem_mib=256, warm_cmd=f"sleep {WARM_S}",
                store_root=str(store.root)), jail=True, timeout=1500)
        except BaseException as err:  # noqa: BLE001 - re-raised by the test below
            outcome["error"] = err

    maker = threading.Thread(target=make)
    maker.start()
    samples: list[tuple[float, dict[str, str], list[str]]] = []
    while maker.is_alive():
        for pid in _parent_vmms():
            st = _status(pid)
            if st is None or st.get("Seccomp") != "2":
                continue   # still setting up (the filter comes just before the guest runs)
            try:
                root = sorted(os.listdir(f"/proc/{pid}/root"))
            except OSError:
                continue   # it exited meanwhile
            samples.append((time.monotonic(), st, root))
        time.sleep(0.5)
    ended = time.monotonic()
    maker.join()
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    result = outcome["result"]
    assert samples, "no jailed parent VMM was seen running its guest"
    uids = set()
    for _, st, root in samples:
        uid = int(st["Uid"].split()[0])
        uids.add(uid)
        assert st["Uid"].split() == [str(uid)] * 4 and st["Gid"].split() == [str(uid)] * 4
        assert int(st["CapEff"], 16) == int(st["CapPrm"], 16) == int(st["CapBnd"], 16) == 0
        assert st["NoNewPrivs"] == "1" and st["Seccomp"] == "2"
        assert st["NSpid"].split()[-1] == "1"   # pid 1 of a PID namespace of its own
        # Its root: a tmpfs with /proc and the paths it was given; no /dev (its devices
        # are descriptors opened before the drop).
        assert "proc" in root and "dev" not in root and "etc" not in root
        assert "home" not in root
    assert len(uids) == 1
    # Sampled while the warm-up ran (its last WARM_S seconds before the result).
    warm_s = result.warm_s  # type: ignore[attr-defined]
    assert warm_s >= WARM_S
    assert any(ended - t <= warm_s + 2 for t, _, _ in samples)
    snap = store.get("jailed")
    assert snap.meta.mem_mib == 256 and snap.meta.warm_up == f"sleep {WARM_S}"
    names = sorted(p.name for p in snap.path.iterdir())
    assert "staging" not in names and "memory.bin" in names and "state.bin" in names
    for p in snap.path.iterdir():
        st_file = p.stat()
        assert st_file.st_uid == os.geteuid() and st_file.st_mode & 0o777 == 0o600, p
    assert st_file.st_nlink == 1


def test_a_failed_jailed_warm_up_registers_nothing(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "store")
    with pytest.raises(ParentFailed) as caught:
        boot_parent(ParentRequest(tag="broken", mem_mib=256, warm_cmd="exit 7",
                                  store_root=str(store.root)), jail=True, timeout=1500)
    assert caught.value.kind == "warm_up" and "exited 7" in caught.value.message
    assert store.list() == []
    assert not [p for p in store.snapshots_dir.iterdir() if p.name.startswith(".pending")]
