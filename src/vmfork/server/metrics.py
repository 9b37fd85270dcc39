"""Prometheus metrics: counters, gauges and histograms, rendered as text format 0.0.4.

Written here rather than taken from ``prometheus_client`` because the daemon needs
four small instruments and a renderer, and vmfork's runtime stays stdlib-only.
Instruments are thread-safe (request threads update them). Gauges whose value
lives elsewhere (sandboxes active: the registry) take a callback read at scrape
time, so the number can never drift from the truth.

Names are ``vmfork_*``; the ones forkd exports (REFERENCE-forkd.md, Operations)
are also rendered under their ``forkd_*`` names so existing dashboards work.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

Labels = tuple[tuple[str, str], ...]

# Seconds: spawn latency spans ~10 ms (one warm child) to minutes (1000 children
# in an emulated host); request latency spans µs to the same.
LATENCY_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                      0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

# Seconds: a diff/live BRANCH pauses for ms, a full one for as long as writing guest RAM.
PAUSE_BUCKETS: tuple[float, ...] = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                    0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# Seconds: a cached image build takes about a second, a fresh one with packages and
# wheels minutes, an import of a large OCI image longer.
BUILD_BUCKETS: tuple[float, ...] = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0,
                                    3600.0)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: Labels, extra: Labels = ()) -> str:
    items = labels + extra
    if not items:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in items) + "}"


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def _key(label_names: Sequence[str], values: dict[str, str]) -> Labels:
    if set(values) != set(label_names):
        raise ValueError(f"labels {sorted(values)} do not match {sorted(label_names)}")
    return tuple((name, values[name]) for name in label_names)


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str, label_names: Sequence[str] = (),
                 aliases: Sequence[str] = ()) -> None:
        self.name = name
        self.help = help_text
        self.label_names = tuple(label_names)
        self.aliases = tuple(aliases)
        self._lock = threading.Lock()

    def samples(self) -> Iterable[tuple[str, Labels, float]]:
        raise NotImplementedError

    def render(self) -> list[str]:
        lines: list[str] = []
        samples = list(self.samples())
        for name in (self.name, *self.aliases):
            lines.append(f"# HELP {name} {self.help}")
            lines.append(f"# TYPE {name} {self.kind}")
            for suffix, labels, value in samples:
                lines.append(f"{name}{suffix}{_labels(labels)} {_number(value)}")
        return lines


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help_text: str, label_names: Sequence[str] = (),
                 aliases: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, label_names, aliases)
        self._values: dict[Labels, float] = {}
        if not self.label_names:
            self._values[()] = 0.0

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        key = _key(self.label_names, labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        with self._lock:
            return self._values.get(_key(self.label_names, labels), 0.0)

    def samples(self) -> Iterable[tuple[str, Labels, float]]:
        with self._lock:
            items = sorted(self._values.items())
        return [("", k, v) for k, v in items]


class Gauge(_Metric):
    """A value set by the code, or read from ``source`` at each scrape."""

    kind = "gauge"

    def __init__(self, name: str, help_text: str, label_names: Sequence[str] = (),
                 aliases: Sequence[str] = (),
                 source: Callable[[], dict[Labels, float]] | None = None) -> None:
        super().__init__(name, help_text, label_names, aliases)
        self._values: dict[Labels, float] = {}
        self._source = source

    def set(self, value: float, **labels: str) -> None:
        with self._lock:
            self._values[_key(self.label_names, labels)] = value

    def samples(self) -> Iterable[tuple[str, Labels, float]]:
        if self._source is not None:
            values = self._source()
        else:
            with self._lock:
                values = dict(self._values)
        return [("", k, v) for k, v in sorted(values.items())]


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help_text: str, label_names: Sequence[str] = (),
                 buckets: Sequence[float] = LATENCY_BUCKETS,
                 aliases: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, label_names, aliases)
        self.buckets = tuple(sorted(buckets))
        # Per label set: per-bucket (non-cumulative) counts, plus +Inf, then the sum.
        self._counts: dict[Labels, list[int]] = {}
        self._sums: dict[Labels, float] = {}

    def observe(self, value: float, **labels: str) -> None:
        key = _key(self.label_names, labels)
        index = bisect.bisect_left(self.buckets, value)
        with self._lock:
            counts = self._counts.setdefault(key, [0] * (len(self.buckets) + 1))
            counts[index] += 1
            self._sums[key] = self._sums.get(key, 0.0) + value

    def count(self, **labels: str) -> int:
        with self._lock:
            return sum(self._counts.get(_key(self.label_names, labels), []))

    def samples(self) -> Iterable[tuple[str, Labels, float]]:
        with self._lock:
            snapshot = {k: (list(v), self._sums[k]) for k, v in self._counts.items()}
        out: list[tuple[str, Labels, float]] = []
        for key, (counts, total) in sorted(snapshot.items()):
            running = 0
            for bound, n in zip((*self.buckets, math.inf), counts, strict=True):
                running += n
                out.append(("_bucket", key + (("le", _number(bound)),), running))
            out.append(("_sum", key, total))
            out.append(("_count", key, running))
        return out


M = TypeVar("M", bound=_Metric)


class MetricsRegistry:
    def __init__(self) -> None:
        self._metrics: list[_Metric] = []

    def add(self, metric: M) -> M:
        self._metrics.append(metric)
        return metric

    def render(self) -> str:
        lines: list[str] = []
        for metric in self._metrics:
            lines.extend(metric.render())
        return "\n".join(lines) + "\n"


class DaemonMetrics:
    """The daemon's instruments. Gauges read the registry and store when scraped
    (``set_sources``), so they always agree with ``GET /v1/sandboxes``."""

    def __init__(self, version: str, branch_concurrency_cap: int = 0) -> None:
        self.registry = MetricsRegistry()
        self._active: Callable[[], int] = lambda: 0
        self._snapshots: Callable[[], dict[str, int]] = dict
        self._branches_in_flight: Callable[[], int] = lambda: 0
        self._image_builds: Callable[[], int] = lambda: 0
        add = self.registry.add
        add(Gauge("vmfork_build_info", "Build information (always 1).", ("version",),
                  aliases=("forkd_build_info",),
                  source=lambda: {(("version", version),): 1.0}))
        self.requests = add(Counter("vmfork_http_requests_total", "HTTP requests by route.",
                                    ("method", "route", "status")))
        self.errors = add(Counter("vmfork_http_errors_total",
                                  "HTTP requests answered with a 4xx or 5xx, by route.",
                                  ("method", "route", "status")))
        self.request_seconds = add(Histogram("vmfork_http_request_duration_seconds",
                                             "Time to answer a request, by route.",
                                             ("method", "route")))
        self.spawn_seconds = add(Histogram(
            "vmfork_spawn_seconds", "POST /v1/sandboxes: request to all children ready "
            "(agents answered), per request.", ("outcome",)))
        self.restore_seconds = add(Histogram(
            "vmfork_restore_seconds", "POST /v1/sandboxes: request to all children restored "
            "(VMs running again), per request."))
        self.sandboxes_spawned = add(Counter("vmfork_sandboxes_spawned_total",
                                             "Sandboxes started."))
        self.sandbox_exits = add(Counter("vmfork_sandbox_exits_total",
                                         "Sandboxes that ended, by reason.", ("reason",)))
        self.heavy_rejected = add(Counter(
            "vmfork_heavy_operations_rejected_total",
            "Heavy operations refused with 503 because the concurrency cap was reached."))
        add(Gauge("vmfork_sandboxes_active", "Sandboxes running now.",
                  aliases=("forkd_sandboxes_active",),
                  source=lambda: {(): float(self._active())}))
        add(Gauge("vmfork_snapshots", "Snapshots by status (ready, writing, failed).",
                  ("status",),
                  source=lambda: {(("status", s),): float(n)
                                  for s, n in self._snapshots().items()}))
        add(Gauge("forkd_snapshots_total", "Snapshots in the store (forkd's name).",
                  source=lambda: {(): float(sum(self._snapshots().values()))}))
        self.branch_pause_seconds = add(Histogram(
            "vmfork_branch_pause_seconds", "POST /v1/sandboxes/:id/branch: time the source "
            "sandbox's vCPUs were paused, by mode.", ("mode",), buckets=PAUSE_BUCKETS))
        self.branches = add(Counter("vmfork_branches_total", "BRANCH snapshots published, "
                                    "by mode.", ("mode",)))
        add(Gauge("vmfork_branches_in_flight", "BRANCH operations running.",
                  aliases=("forkd_branches_in_flight",),
                  source=lambda: {(): float(self._branches_in_flight())}))
        add(Gauge("forkd_branch_concurrency_cap", "Maximum concurrent BRANCH operations.",
                  source=lambda: {(): float(branch_concurrency_cap)}))
        self.image_builds = add(Counter(
            "vmfork_image_builds_total", "Image builds and imports that ended, by kind "
            "(build, import) and outcome (ok, failed).", ("kind", "outcome")))
        self.image_build_seconds = add(Histogram(
            "vmfork_image_build_seconds", "POST /v1/images[/import]: job start to end, by kind "
            "and outcome.", ("kind", "outcome"), buckets=BUILD_BUCKETS))
        add(Gauge("vmfork_image_builds_in_flight", "Image builds and imports running.",
                  source=lambda: {(): float(self._image_builds())}))

    def set_sources(self, sandboxes_active: Callable[[], int],
                    snapshots_by_status: Callable[[], dict[str, int]],
                    branches_in_flight: Callable[[], int] = lambda: 0) -> None:
        self._active = sandboxes_active
        self._snapshots = snapshots_by_status
        self._branches_in_flight = branches_in_flight

    def set_image_source(self, image_builds_in_flight: Callable[[], int]) -> None:
        self._image_builds = image_builds_in_flight

    def render(self) -> str:
        return self.registry.render()
