"""The zygote's forker's spare (native/src/forker_spare.rs), seen from the outside.

After a lone spawn, once its channel was quiet, a forker forks a spare: a child of the
zygote's that the zygote does not know until the next lone spawn is that process. A
test that counts the zygote's children or descriptors waits for it first.
"""

from __future__ import annotations

import time
from pathlib import Path

from vmfork.runtime.zygote_client import ZygoteProcess


def spare_of(zygote: ZygoteProcess, timeout: float = 120.0) -> int:
    """The pid of the zygote's one child that is neither a child it knows nor its
    forker, once there is one: the forker's spare."""
    deadline = time.monotonic() + timeout
    with zygote.client() as client:
        while True:
            known = {child.pid for child in client.list()}
            forker = client.ping()["forker"]
            children = Path(f"/proc/{zygote.pid}/task/{zygote.pid}/children").read_text()
            others = {int(p) for p in children.split()} - known - {
                forker["pid"] if forker else -1}
            if others:
                (spare,) = others
                return spare
            assert time.monotonic() < deadline, "the forker forked no spare"
            time.sleep(0.1)
