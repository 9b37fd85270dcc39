"""Bounded bookkeeping for anything a guest can drive.

A guest runs untrusted code and chooses the ports, addresses, CIDs and bytes it sends.
Any host-side structure keyed or grown by those choices (a counter per address, a log
line per packet) is memory or disk the guest can take from the host. Everything here
has a size fixed when it is made, whatever the guest does.

* ``BoundedCounter``: counts per key for the first ``capacity`` distinct keys, the rest
  summed in ``other``. The top-N view of exits stays useful (a guest's hot ports are
  its first ones) and never grows past the table.
* ``LogBudget``: a token bucket (``burst`` lines, refilled at ``per_second``) plus a
  lifetime cap of ``total_bytes``; what it refuses is counted, and the caller writes
  one marker line saying how much was dropped when output resumes or stops for good.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class BoundedCounter(Generic[K]):
    def __init__(self, capacity: int = 64) -> None:
        self.capacity = capacity
        self._counts: dict[K, int] = {}
        self.other = 0
        """The count of every key that came after the table was full."""

    def add(self, key: K, n: int = 1) -> None:
        if key in self._counts:
            self._counts[key] += n
        elif len(self._counts) < self.capacity:
            self._counts[key] = n
        else:
            self.other += n

    def __getitem__(self, key: K) -> int:
        return self._counts.get(key, 0)

    def get(self, key: K, default: int | None = None) -> int | None:
        return self._counts.get(key, default)

    def __len__(self) -> int:
        return len(self._counts)

    def __iter__(self) -> Iterator[K]:
        return iter(self._counts)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BoundedCounter):
            return self._counts == other._counts and self.other == other.other
        if isinstance(other, dict):
            return self.other == 0 and self._counts == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def items(self) -> list[tuple[K, int]]:
        return list(self._counts.items())

    def most_common(self, n: int | None = None) -> list[tuple[K, int]]:
        ranked = sorted(self._counts.items(), key=lambda kv: kv[1], reverse=True)
        return ranked if n is None else ranked[:n]

    def total(self) -> int:
        return sum(self._counts.values()) + self.other

    def __repr__(self) -> str:
        return f"BoundedCounter({self._counts!r}, other={self.other})"


class LogBudget:
    """Decides whether one more line of ``size`` bytes may be written.

    ``take`` answers (allowed, marker): ``marker`` is a line to write first when lines
    were dropped since the last one allowed (so the log says where and how much), or
    the final truncation notice once ``total_bytes`` is spent. Thread-safe.
    """

    def __init__(self, what: str, *, burst: int = 2000, per_second: float = 200.0,
                 total_bytes: int = 16 << 20) -> None:
        self.what = what
        self.burst = burst
        self.per_second = per_second
        self.total_bytes = total_bytes
        self._tokens = float(burst)
        self._stamp = time.monotonic()
        self._written = 0
        self.dropped = 0
        self._unreported = 0
        self._exhausted = False
        self._lock = threading.Lock()

    def take(self, size: int) -> tuple[bool, str | None]:
        with self._lock:
            if self._exhausted:
                self.dropped += 1
                return False, None
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.per_second)
            self._stamp = now
            if self._written + size > self.total_bytes:
                self._exhausted = True
                self.dropped += 1
                return False, (f"[vmfork: {self.what} truncated here: it reached its "
                               f"{self.total_bytes} byte limit; later lines are dropped]")
            if self._tokens < 1:
                self.dropped += 1
                self._unreported += 1
                return False, None
            marker = None
            if self._unreported:
                marker = (f"[vmfork: {self._unreported} {self.what} lines dropped: more than "
                          f"{self.per_second:g} lines/s]")
                if self._written + size + len(marker) + 1 > self.total_bytes:
                    marker = None   # let the truncation notice say it, next time
                else:
                    self._unreported = 0
                    size += len(marker) + 1   # markers count against the cap too
            self._tokens -= 1
            self._written += size
            return True, marker


class BudgetFilter(logging.Filter):
    """A ``LogBudget`` for a logging handler (the VMM's own log): records over the
    budget are dropped, and a marker record says so when logging resumes."""

    def __init__(self, budget: LogBudget) -> None:
        super().__init__()
        self.budget = budget

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        allowed, marker = self.budget.take(len(message) + 64)
        if marker is not None:
            # Prepended to this record rather than logged anew (which would re-enter
            # the filter); a final notice rides on a record that is then let through.
            record.msg = f"{marker}\n{message}" if allowed else marker
            record.args = ()
            return True
        return allowed


def limit_log_handlers(logger: logging.Logger, budget: LogBudget) -> None:
    """Put one shared budget on every handler of ``logger`` (the root logger in a VMM
    process), so no guest-triggered log line can fill the disk or the CPU."""
    for handler in logger.handlers:
        handler.addFilter(BudgetFilter(budget))
