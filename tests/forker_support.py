"""The zygote's forker's spare (native/src/forker_spare.rs), seen from the outside.

After a lone spawn, once its channel was quiet, a forker forks a spare: a child of the
zygote's that the zygote does not know until the next lone spawn is that process. A
test that counts the zygote's children or descriptors waits for it first.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from vmfork.runtime.zygote_client import ZygoteClient, ZygoteProcess


def spare_of(zygote: ZygoteProcess, timeout: float = 120.0,
             client: ZygoteClient | None = None) -> int:
    """The pid of the zygote's one child that is neither a child it knows nor its
    forker, once there is one: the forker's spare. ``client``: a connection of the
    caller's to ask through (else one of its own, which the zygote closes a moment
    after this returns: a test counting the zygote's descriptors passes its own)."""
    deadline = time.monotonic() + timeout
    with contextlib.nullcontext(client) if client is not None else zygote.client() as client:
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
