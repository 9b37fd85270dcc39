"""Prometheus metrics for the daemon, on ``prometheus_client``.

Counters and histograms are ``prometheus_client``'s own, in a registry per daemon (so
two daemons in one process, as the tests run them, never share a sample). The call
sites name their labels as keywords (``exits.inc(reason="lost")``); the two small
classes below keep that form over ``prometheus_client``'s ``labels(...).inc()``.

Gauges whose value lives elsewhere (sandboxes active: the registry) are read at
scrape time by one collector, so the number can never drift from the truth. Names
are ``vmfork_*``; the ones forkd exports (REFERENCE-forkd.md, Operations) are also
rendered under their ``forkd_*`` names so existing dashboards work.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import prometheus_client
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# ``prometheus_client`` adds a ``*_created`` series (a Unix time) to every counter and
# histogram; nothing reads them here and they double the page. Process-wide switch.
prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]  # unannotated upstream

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST

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


class Counter:
    """A counter whose labels are given as keywords at each increment."""

    def __init__(self, registry: CollectorRegistry, name: str, help_text: str,
                 label_names: Sequence[str] = ()) -> None:
        self._registry = registry
        self._name = name
        self._labelled = bool(label_names)
        # prometheus_client names a counter without its ``_total`` and adds it back.
        self._metric = prometheus_client.Counter(name.removesuffix("_total"), help_text,
                                                 tuple(label_names), registry=registry)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        """Raises ValueError for a negative amount or labels other than the declared."""
        (self._metric.labels(**labels) if self._labelled or labels else self._metric).inc(amount)

    def value(self, **labels: str) -> float:
        return self._registry.get_sample_value(self._name, labels) or 0.0


class Histogram:
    """A histogram whose labels are given as keywords at each observation."""

    def __init__(self, registry: CollectorRegistry, name: str, help_text: str,
                 label_names: Sequence[str] = (),
                 buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        self._registry = registry
        self._name = name
        self._labelled = bool(label_names)
        self._metric = prometheus_client.Histogram(name, help_text, tuple(label_names),
                                                   registry=registry, buckets=tuple(buckets))

    def observe(self, value: float, **labels: str) -> None:
        (self._metric.labels(**labels) if self._labelled or labels else self._metric
         ).observe(value)

    def count(self, **labels: str) -> int:
        return int(self._registry.get_sample_value(f"{self._name}_count", labels) or 0)


@dataclass(frozen=True)
class _ScrapedGauge:
    name: str
    help: str
    label_names: tuple[str, ...]
    # Label values (in label_names' order) -> value, read at each scrape.
    read: Callable[[], dict[tuple[str, ...], float]]
    aliases: tuple[str, ...] = ()


class _ScrapedGauges(Collector):
    """Gauges read from their source when scraped, each also under its aliases."""

    def __init__(self) -> None:
        self.gauges: list[_ScrapedGauge] = []

    def collect(self) -> Iterator[Metric]:
        for gauge in self.gauges:
            values = gauge.read()
            for name in (gauge.name, *gauge.aliases):
                family = GaugeMetricFamily(name, gauge.help, labels=gauge.label_names)
                for label_values, value in sorted(values.items()):
                    family.add_metric(list(label_values), value)
                yield family


class DaemonMetrics:
    """The daemon's instruments. Gauges read the registry and store when scraped
    (``set_sources``), so they always agree with ``GET /v1/sandboxes``."""

    def __init__(self, version: str, branch_concurrency_cap: int = 0) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._active: Callable[[], int] = lambda: 0
        self._snapshots: Callable[[], dict[str, int]] = dict
        self._branches_in_flight: Callable[[], int] = lambda: 0
        self._image_builds: Callable[[], int] = lambda: 0
        reg = self.registry
        scraped = _ScrapedGauges()

        def gauge(name: str, help_text: str, read: Callable[[], dict[tuple[str, ...], float]],
                  label_names: tuple[str, ...] = (), aliases: tuple[str, ...] = ()) -> None:
            scraped.gauges.append(_ScrapedGauge(name, help_text, label_names, read, aliases))

        gauge("vmfork_build_info", "Build information (always 1).", lambda: {(version,): 1.0},
              ("version",), aliases=("forkd_build_info",))
        self.requests = Counter(reg, "vmfork_http_requests_total", "HTTP requests by route.",
                                ("method", "route", "status"))
        self.errors = Counter(reg, "vmfork_http_errors_total",
                              "HTTP requests answered with a 4xx or 5xx, by route.",
                              ("method", "route", "status"))
        self.request_seconds = Histogram(reg, "vmfork_http_request_duration_seconds",
                                         "Time to answer a request, by route.",
                                         ("method", "route"))
        self.spawn_seconds = Histogram(
            reg, "vmfork_spawn_seconds", "POST /v1/sandboxes: request to all children ready "
            "(agents answered), per request.", ("outcome",))
        self.restore_seconds = Histogram(
            reg, "vmfork_restore_seconds", "POST /v1/sandboxes: request to all children "
            "restored (VMs running again), per request.")
        self.sandboxes_spawned = Counter(reg, "vmfork_sandboxes_spawned_total",
                                         "Sandboxes started.")
        self.sandbox_exits = Counter(reg, "vmfork_sandbox_exits_total",
                                     "Sandboxes that ended, by reason.", ("reason",))
        self.heavy_rejected = Counter(
            reg, "vmfork_heavy_operations_rejected_total",
            "Heavy operations refused with 503 because the concurrency cap was reached.")
        gauge("vmfork_sandboxes_active", "Sandboxes running now.",
              lambda: {(): float(self._active())}, aliases=("forkd_sandboxes_active",))
        gauge("vmfork_snapshots", "Snapshots by status (ready, writing, failed).",
              lambda: {(s,): float(n) for s, n in self._snapshots().items()}, ("status",))
        gauge("forkd_snapshots_total", "Snapshots in the store (forkd's name).",
              lambda: {(): float(sum(self._snapshots().values()))})
        self.branch_pause_seconds = Histogram(
            reg, "vmfork_branch_pause_seconds", "POST /v1/sandboxes/:id/branch: time the "
            "source sandbox's vCPUs were paused, by mode.", ("mode",), buckets=PAUSE_BUCKETS)
        self.branches = Counter(reg, "vmfork_branches_total",
                                "BRANCH snapshots published, by mode.", ("mode",))
        gauge("vmfork_branches_in_flight", "BRANCH operations running.",
              lambda: {(): float(self._branches_in_flight())},
              aliases=("forkd_branches_in_flight",))
        gauge("forkd_branch_concurrency_cap", "Maximum concurrent BRANCH operations.",
              lambda: {(): float(branch_concurrency_cap)})
        self.image_builds = Counter(
            reg, "vmfork_image_builds_total", "Image builds and imports that ended, by kind "
            "(build, import) and outcome (ok, failed).", ("kind", "outcome"))
        self.image_build_seconds = Histogram(
            reg, "vmfork_image_build_seconds", "POST /v1/images[/import]: job start to end, by "
            "kind and outcome.", ("kind", "outcome"), buckets=BUILD_BUCKETS)
        gauge("vmfork_image_builds_in_flight", "Image builds and imports running.",
              lambda: {(): float(self._image_builds())})
        reg.register(scraped)

    def set_sources(self, sandboxes_active: Callable[[], int],
                    snapshots_by_status: Callable[[], dict[str, int]],
                    branches_in_flight: Callable[[], int] = lambda: 0) -> None:
        self._active = sandboxes_active
        self._snapshots = snapshots_by_status
        self._branches_in_flight = branches_in_flight

    def set_image_source(self, image_builds_in_flight: Callable[[], int]) -> None:
        self._image_builds = image_builds_in_flight

    def render(self) -> str:
        return prometheus_client.generate_latest(self.registry).decode()
