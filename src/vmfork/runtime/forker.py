"""The zygote's forker: a copy of the zygote that forks its native children and runs no
Python (``native/src/forker.rs`` says why and how; docs/native.md, "The forker").

The zygote clones one (``Forker``) once a batch's snapshot plans are built, and sends it
each later batch of native children as plain values (``NativeChild.recipe`` and the
``ChildPlan``'s arguments, ``zygote_child.plan_args``). The children are the zygote's
(cloned with ``CLONE_PARENT``), so it reaps and watches them as any other. A forker
serves the batches whose snapshot plans it has in its image and whose image key (the
entry module's ``forker_image_key``: the premaps a child inherits) is the one it was
cloned with; any other batch makes the zygote clone a new one and retire the old.

On by default; ``VMFORK_FORKER=0`` (``wanted``) makes the zygote fork its native
children itself.

After a lone batch the forker forks a spare, the next lone child, once its channel has
been quiet for ``SPARE_QUIET_S`` (``native/src/forker_spare.rs``): the next lone spawn
costs no fork. A spare is the zygote's child, unknown to it until the forker tells its
pid as a forked child's; the zygote kills and reaps the children it does not know when
it retires a forker. ``VMFORK_FORKER_SPARE=0`` turns spares off; another number is
the quiet time in seconds.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import time
from collections.abc import Hashable
from typing import Any

FORKER_ENV = "VMFORK_FORKER"
"""``0``: the zygote forks its native children itself, with no forker."""

SPARE_ENV = "VMFORK_FORKER_SPARE"
"""``0``: no spares; a number: the quiet time before one is forked, in seconds."""

SPARE_QUIET_S = 0.5
"""How long a forker's channel stays quiet after a lone batch before it forks a spare:
long enough that the fork does not take the CPU from the child just spawned on its way
to ready (~0.2 s in the emulated test host), short beside the time between two spawns
of an agent's sandbox."""

MAX_REPLY_LINE = 4096
"""The longest line a forker answers (a pid, or a batch's end with its error)."""


def wanted() -> bool:
    """Whether the zygote's native children come from a forker: yes unless
    ``VMFORK_FORKER=0``."""
    return os.environ.get(FORKER_ENV) != "0"


def spare_quiet_ms() -> int | None:
    """``VMFORK_FORKER_SPARE`` as the forker takes it: milliseconds, or None for no
    spares. Raises ``ValueError`` naming the variable for a value that is not a
    number of seconds."""
    value = os.environ.get(SPARE_ENV)
    if value is None:
        return int(SPARE_QUIET_S * 1000)
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{SPARE_ENV}={value!r}: 0 (no spares) or the seconds a "
                         "forker waits before it forks one") from None
    if not 0 <= seconds <= 3600:
        raise ValueError(f"{SPARE_ENV}={value!r}: between 0 and 3600 seconds")
    return None if seconds == 0 else max(1, int(seconds * 1000))


class ForkerGone(RuntimeError):
    """The forker died, or stopped answering, during a batch."""


class Forker:
    """One forker and its channel; ``close`` kills and reaps it.

    ``plans``: the snapshot plans its image holds (``_core.kept_snapshot_plans()`` at
    the clone); ``image_key``: the entry module's key at the clone. The two ends of
    the channel, and of the spares' (``spare_quiet_ms``), stay open here for the
    forker's life: the zygote and the forker share one descriptor table, so closing an
    end here would close it for the forker.
    """

    def __init__(self, image_key: Hashable) -> None:
        from vmfork import _core
        self.image_key = image_key
        self.plans = frozenset(_core.kept_snapshot_plans())
        self._mine, self._its = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # The forker's spares' channel (forker_spare.rs): made and closed here, since a
        # descriptor the forker opened and left would stay in this shared table.
        quiet = spare_quiet_ms()
        self._spares: tuple[socket.socket, ...] = (
            socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) if quiet is not None
            else ())
        try:
            self.pid: int = _core.start_forker(
                self._its.fileno(),
                (self._spares[0].fileno(), self._spares[1].fileno()) if self._spares
                else None, quiet)
        except BaseException:
            for end in (self._mine, self._its, *self._spares):
                end.close()
            raise
        self.pidfd = os.pidfd_open(self.pid)
        self._buffer = b""
        self.alive = True

    def serves(self, plans: set[int], image_key: Hashable) -> bool:
        """Whether this forker can fork children of ``plans`` (snapshot plan numbers):
        it holds them, was cloned with ``image_key``, and has not exited."""
        if self.alive and select.select([self.pidfd], [], [], 0)[0]:
            self.alive = False   # killed between two batches: its pidfd says so
        return self.alive and plans <= self.plans and image_key == self.image_key

    def fork(self, recipes: list[dict[str, Any]], timeout: float
             ) -> tuple[list[int], BaseException | None]:
        """Fork one child per recipe, back to back: the pids forked, in order, and what
        stopped the rest (``OSError`` with the forker's errno, ``RuntimeError`` for a
        batch it could not build, ``ForkerGone``), None if all were forked. ``timeout``
        (seconds) bounds the whole batch."""
        body = json.dumps({"children": recipes}).encode()
        deadline = time.monotonic() + timeout
        pids: list[int] = []
        try:
            self._mine.sendall(struct.pack("<I", len(body)) + body)
            while True:
                reply = json.loads(self._line(deadline))
                if "pid" in reply:
                    pids.append(int(reply["pid"]))
                    continue
                error, errno = reply.get("error"), reply.get("errno")
                if error is None:
                    return pids, None
                if errno is not None:
                    return pids, OSError(int(errno), str(error))
                return pids, RuntimeError(f"the forker: {error}")
        except (OSError, ValueError, ForkerGone) as err:
            self.alive = False
            gone = err if isinstance(err, ForkerGone) else ForkerGone(f"the forker: {err}")
            return pids, gone

    def _line(self, deadline: float) -> bytes:
        while b"\n" not in self._buffer:
            if len(self._buffer) > MAX_REPLY_LINE:
                raise ForkerGone("the forker answered a line too long")
            left = deadline - time.monotonic()
            if left <= 0:
                raise ForkerGone("the forker did not finish its batch in time")
            ready, _, _ = select.select([self._mine.fileno(), self.pidfd], [], [], left)
            if self._mine.fileno() in ready:
                chunk = self._mine.recv(MAX_REPLY_LINE)
                if not chunk:
                    raise ForkerGone("the forker's channel closed")
                self._buffer += chunk
            elif self.pidfd in ready:
                raise ForkerGone("the forker exited")
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def close(self) -> None:
        """Kill the forker and reap it; its children, the zygote's, live on (its
        spare too, until it sees the forker gone: the zygote reaps it)."""
        if self.pidfd < 0:
            return
        try:
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitid(os.P_PIDFD, self.pidfd, os.WEXITED)
        os.close(self.pidfd)
        self.pidfd = -1
        self.alive = False
        for end in (self._mine, self._its, *self._spares):
            end.close()
