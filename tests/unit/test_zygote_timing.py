"""How long a spawn takes, with a trivial entry: request -> pid reply, and fork -> entry.

For N = 1, 10 and 100 children (one ``spawn_many``), measured against the default
preloads (the VMM modules), so fork copies a realistic zygote. Prints a table
(``-s`` to see it); asserts only bounds loose enough for a noisy shared machine,
which still catch a spawn that paid interpreter start-up (~70 ms per child here).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from vmfork.runtime.zygote_client import ZygoteProcess, start_zygote
from vmfork.runtime.zygote_protocol import SpawnItem

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ZygoteProcess]:
    tmp = tmp_path_factory.mktemp("ztiming")
    z = start_zygote(tmp / "z.sock", env=dict(os.environ, PYTHONPATH=str(HERE)),
                     entries_modules=["test_zygote_entries"])
    yield z
    z.close()


def _measure(z: ZygoteProcess, n: int, out: Path) -> dict[str, float]:
    out.mkdir()
    items = [SpawnItem(f"n{n}-{i}", {"out": str(out)}) for i in range(n)]
    with z.client() as c:
        c.ping()
        t0 = time.monotonic_ns()
        result = c.spawn_many("test_zygote_entries:fork_to_entry", items)
        t_reply = time.monotonic_ns()
        assert result.failed == [] and len(result.children) == n
        events = [c.wait(ch.vm_id) for ch in result.children]
    assert all(e.exit_code == 0 for e in events)
    records = [tuple(int(x) for x in (out / it.vm_id).read_text().split()) for it in items]
    fork_to_entry = [r[0] / 1e6 for r in records]
    last_entry = max(r[1] for r in records)
    return {"reply_ms": (t_reply - t0) / 1e6, "per_child_ms": (t_reply - t0) / 1e6 / n,
            "fork_to_entry_median_ms": statistics.median(fork_to_entry),
            "fork_to_entry_max_ms": max(fork_to_entry),
            "all_entries_running_ms": (last_entry - t0) / 1e6}


def test_spawn_latency(zygote: ZygoteProcess, tmp_path: Path) -> None:
    _measure(zygote, 5, tmp_path / "warmup")
    rows = {n: _measure(zygote, n, tmp_path / f"n{n}") for n in (1, 10, 100)}
    print("\n   N  request->reply  per child  fork->entry med/max  request->all entries running")
    for n, r in rows.items():
        print(f"{n:4d}  {r['reply_ms']:11.2f} ms  {r['per_child_ms']:6.2f} ms"
              f"  {r['fork_to_entry_median_ms']:7.2f} / {r['fork_to_entry_max_ms']:6.2f} ms"
              f"  {r['all_entries_running_ms']:9.2f} ms")
    assert rows[1]["reply_ms"] < 50
    assert rows[100]["per_child_ms"] < 20
    # The best median of the three batches: one child's fork -> entry on a loaded machine
    # can be a scheduling delay (69 ms once, beside the 200-children heavy test), but a
    # spawn that paid interpreter start-up pays it in every batch.
    assert min(r["fork_to_entry_median_ms"] for r in rows.values()) < 20
