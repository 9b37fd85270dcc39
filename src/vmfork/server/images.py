"""Guest images through the daemon: builds and OCI imports as jobs, and the list.

``vmfork.image`` does the work (``builder.build``, ``builder.import_oci``,
``builder.remove_image``); this module turns it into REST semantics:

* A build or import runs in a worker thread of its own, whether or not the
  client waits (``wait:true`` waits on the job), so ``GET /v1/images/{name}``
  shows the same job either way: ``building`` with the builder's progress lines
  (the last ``PROGRESS_LINES`` of them, each cut to ``MAX_MESSAGE``), then the
  image record (``ready``) or ``failed`` with the reason. The builder writes the
  image's record last, so a failed build never leaves a half-built image
  listed; a failed rebuild of an existing name leaves the previous image in
  place, shown under ``previous``.
* One job per name at a time (409 for a second), at most
  ``Limits.image_builds`` at once (503 with ``Retry-After``): a build saturates
  the host's CPUs while compressing the disk.
* The daemon never compiles the guest kernel (minutes of every core): a build is
  refused with 409 until ``vmfork image build`` has built it once on the host,
  as snapshot creation is refused until an image exists.
* Jobs live in memory. A daemon that stops mid-build abandons it; the builder's
  atomic publication means nothing half-built is ever recorded, and the restarted
  daemon shows the name as it is on disk (the previous image, or 404).

Finished jobs are kept (at most ``MAX_FINISHED_JOBS``, oldest dropped first) so a
client polling a ``wait:false`` build sees how it ended; a ready job is shown as
the image's record, which is the truth once written.
"""

from __future__ import annotations

import importlib
import logging
import re
import shutil
import tempfile
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from vmfork.image import GuestImage, ImageError, ImageMissing, list_images, read_record
from vmfork.image.spec import CopySpec, ImageSpec, SpecError
from vmfork.server.errors import (
    ApiError,
    BadRequest,
    Busy,
    Conflict,
    InternalError,
    NotFound,
    NotImplementedApi,
    Unprocessable,
)
from vmfork.server.metrics import DaemonMetrics
from vmfork.store import Store

log = logging.getLogger(__name__)

PROGRESS_LINES = 200
MAX_MESSAGE = 2000
MAX_FINISHED_JOBS = 256
BUILD_KINDS = ("build", "import")

BUILDING = "building"
READY = "ready"
FAILED = "failed"

Work = Callable[[Callable[[str, str], None]], GuestImage]


@dataclass
class ImageJob:
    """One build or import of ``name``; its fields change only under ``lock``."""

    name: str
    kind: str                               # build | import
    source: str                             # the base image, or the OCI reference
    started_at: float
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    done: threading.Event = field(default_factory=threading.Event, repr=False)
    status: str = BUILDING
    progress: deque[dict[str, Any]] = field(
        default_factory=lambda: deque(maxlen=PROGRESS_LINES))
    lines: int = 0
    error: ApiError | None = None
    image: GuestImage | None = None
    finished_at: float | None = None

    def report(self, step: str, message: str) -> None:
        """The builder's progress callback (called from the job's thread)."""
        with self.lock:
            self.lines += 1
            self.progress.append({"step": step[:64], "message": message[:MAX_MESSAGE],
                                  "at": round(time.time(), 3)})

    def info(self) -> dict[str, Any]:
        with self.lock:
            out: dict[str, Any] = {
                "name": self.name, "status": self.status, "kind": self.kind,
                "from": self.source, "started_at_unix": round(self.started_at, 3),
                "progress": list(self.progress), "progress_lines": self.lines}
            if self.finished_at is not None:
                out["finished_at_unix"] = round(self.finished_at, 3)
            if self.error is not None:
                out["error"] = self.error.message
        return out


def image_info(image: GuestImage) -> dict[str, Any]:
    """The wire record of a built image (``ImageInfo`` in openapi.json)."""
    disk = image.disk
    return {
        "name": image.name, "status": READY, "size": image.size,
        "root": "disk" if image.disk_key else "initramfs",
        "disk_format": image.disk_format, "disk": str(disk) if disk else None,
        "disk_size": image.disk_size, "kernel_size": image.kernel_size,
        "initrd_size": image.initrd_size, "built_from": image.built_from,
        "definition": image.definition, "created": image.created.isoformat(),
        "env": list(image.env), "workdir": image.workdir, "user": image.user,
        "agent_python": image.agent_python, "files_present": image.files_present()}


def spec_from_body(body: dict[str, Any], requirements: Path | None) -> ImageSpec:
    """The ``ImageSpec`` a validated ``POST /v1/images`` body describes; raises
    ``BadRequest`` with ``SpecError``'s message (it names the field)."""
    copies = []
    for i, item in enumerate(body["copy"]):
        src, dst = item["src"], item["dst"]
        source = Path(src)
        if not source.is_absolute():
            raise BadRequest(f"copy[{i}].src: {src[:200]!r} must be an absolute path on the "
                             "daemon's host (the daemon's working directory means nothing "
                             "to a client)")
        # Resolved as the CLI's parse_copy does: the record names the real file.
        copies.append(CopySpec(source.resolve(), dst))
    try:
        return ImageSpec(
            base=body["from"], apt=tuple(body["apt"]), pip=tuple(body["pip"]),
            requirements=requirements, pip_index_url=body["pip_index_url"],
            pip_find_links=tuple(body["pip_find_links"]), pip_no_index=body["pip_no_index"],
            npm=tuple(body["npm"]), copy=tuple(copies),
            env=tuple((str(k), v) for k, v in body["env"].items()),
            workdir=body["workdir"], user=body["user"],
            disk_format=body["disk_format"], run=tuple(body["run"]),
            egress=body["egress"], run_mem_mib=body["run_mem_mib"]).validate()
    except SpecError as err:
        raise BadRequest(f"POST /v1/images: {err}") from err


_HASH_OPTION = re.compile(r"\s+--hash[= ](sha256|sha384|sha512):[0-9a-f]{64,128}")


def check_requirements(text: str) -> None:
    """Refuse a requirements file that is more than requirements (each may be pinned by
    ``--hash``). pip reads it on the daemon's host: ``-r``/``-c`` would read other host
    files, ``-e``/``--index-url``/``--find-links`` would fetch from where the client
    says; the request's own fields cover the last two, in the open."""
    logical = re.sub(r"\\\n", " ", text)     # joins backslash continuations
    for number, line in enumerate(logical.splitlines(), 1):
        requirement = _HASH_OPTION.sub("", line.split(" #", 1)[0]).strip()
        if not requirement or requirement.startswith("#"):
            continue
        try:
            ImageSpec(pip=(requirement,)).validate()
        except SpecError:
            raise BadRequest(f"POST /v1/images: field 'requirements', line {number}: "
                             f"{requirement[:120]!r} is not a requirement (e.g. "
                             "numpy==2.0.2, optionally with --hash=sha256:...); pip options "
                             "are not accepted: use pip_index_url, pip_find_links and "
                             "pip_no_index") from None


def kernel_ready() -> str | None:
    """None if the guest kernel is cached, else why a build through the daemon is refused."""
    from vmfork.image import kernel_path
    from vmfork.image.kernel import kernel_key

    try:
        if kernel_path(kernel_key()).is_file():
            return None
    except OSError as err:
        return (f"the guest kernel's inputs cannot be read ({err}); run `vmfork image build` "
                "on the daemon's host to see what is missing")
    return ("the guest kernel is not built on the daemon's host, and the daemon does not "
            "compile it (minutes of every core): run `vmfork image build` there once, then "
            "build images through the API")


class ImageBuilds:
    """The daemon's image jobs and the image list (see the module docstring)."""

    def __init__(self, store: Store, metrics: DaemonMetrics, *, concurrency: int,
                 retry_after_s: int) -> None:
        self.store = store
        self.metrics = metrics
        self.concurrency = concurrency
        self.retry_after_s = retry_after_s
        self._lock = threading.Lock()
        self._running: dict[str, ImageJob] = {}
        self._finished: OrderedDict[str, ImageJob] = OrderedDict()
        self._threads: dict[str, threading.Thread] = {}
        metrics.set_image_source(lambda: len(self._running))

    # -- reading --------------------------------------------------------------------

    def list_all(self) -> list[dict[str, Any]]:
        # Jobs first, records second (as the snapshot list): a job writes its record
        # before it is marked finished, so a build finishing between the reads is found
        # by the second.
        with self._lock:
            running = dict(self._running)
            failed = {n: j for n, j in self._finished.items() if j.status == FAILED}
        out: dict[str, dict[str, Any]] = {i.name: image_info(i) for i in list_images()}
        for name, job in failed.items():
            if not _newer(out.get(name), job):
                out[name] = self._failed_info(job, out.get(name))
        for name, job in running.items():
            out[name] = {**job.info(), **({"previous": out[name]} if name in out else {})}
        return [out[name] for name in sorted(out)]

    def get(self, name: str) -> dict[str, Any]:
        with self._lock:
            job = self._running.get(name) or self._finished.get(name)
        previous = self._record(name)
        if job is not None and job.status == BUILDING:
            return {**job.info(), **({"previous": previous} if previous else {})}
        if job is not None and job.status == FAILED and not _newer(previous, job):
            return self._failed_info(job, previous)
        if previous is None:
            raise NotFound(f"no image {name!r}; GET /v1/images lists them, POST /v1/images "
                           "builds one")
        return previous

    @staticmethod
    def _failed_info(job: ImageJob, previous: dict[str, Any] | None) -> dict[str, Any]:
        info = job.info()
        if previous is not None:
            info["previous"] = previous   # still there, still usable
        return info

    @staticmethod
    def _record(name: str) -> dict[str, Any] | None:
        try:
            return image_info(read_record(name))
        except ImageMissing:
            return None

    def users(self, name: str) -> list[str]:
        """The snapshots booted from image ``name``."""
        return sorted(s.tag for s in self.store.list() if s.meta.image == name)

    # -- building -------------------------------------------------------------------

    def build(self, name: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """``POST /v1/images``: 201 with the image (``wait``), or 202 with the job."""
        scratch: Path | None = None
        requirements: Path | None = None
        if body["requirements"] is not None:
            check_requirements(body["requirements"])
            # The builder reads a file; the client sent its text. The file lives as long
            # as the job (removed when it ends).
            scratch = Path(tempfile.mkdtemp(prefix="vmfork-image-request-"))
            requirements = scratch / "requirements.txt"
            requirements.write_text(body["requirements"])
        try:
            spec = spec_from_body(body, requirements)
            if spec.base not in (None, "default"):
                try:
                    read_record(spec.base)
                except ImageMissing as err:
                    raise NotFound(f"POST /v1/images: field 'from': {err}") from err
            from vmfork.image.builder import build

            def work(progress: Callable[[str, str], None]) -> GuestImage:
                return build(name, spec, progress=progress)

            return self._start(name, "build", spec.base or "default", work, body["wait"],
                               scratch)
        except BaseException:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
            raise

    def import_oci(self, name: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """``POST /v1/images/import``: an OCI image as image ``name``."""
        try:
            # The OCI importer may be absent from this build; the builder imports it
            # inside the job, so look first and refuse before a job starts.
            importlib.import_module("vmfork.image.oci")
            from vmfork.image.builder import import_oci
        except ImportError as err:
            raise NotImplementedApi(f"POST /v1/images/import: this daemon cannot import OCI "
                                    f"images: {err}; upgrade vmfork, or build the image "
                                    "with POST /v1/images") from err
        ref, insecure = body["ref"], body["insecure"]

        def work(progress: Callable[[str, str], None]) -> GuestImage:
            return import_oci(name, ref, progress=progress, insecure=insecure)

        return self._start(name, "import", ref, work, body["wait"], None)

    def _start(self, name: str, kind: str, source: str, work: Work, wait: bool,
               scratch: Path | None) -> tuple[int, dict[str, Any]]:
        problem = kernel_ready()
        if problem is not None:
            raise Conflict(f"cannot build image {name!r}: {problem}")
        job = ImageJob(name, kind, source, time.time())
        with self._lock:
            if name in self._running:
                raise Conflict(f"image {name!r} is already being built (since "
                               f"{_iso(self._running[name].started_at)}); wait for it: GET "
                               f"/v1/images/{name}")
            if len(self._running) >= self.concurrency:
                self.metrics.heavy_rejected.inc()
                raise Busy(f"image {kind} {name!r}: {self.concurrency} image builds are "
                           f"already running; retry after {self.retry_after_s} s",
                           self.retry_after_s)
            self._running[name] = job
            self._finished.pop(name, None)
            thread = threading.Thread(target=self._run, args=(job, work, scratch),
                                      name=f"image-{kind}-{name}", daemon=True)
            self._threads[name] = thread
        thread.start()
        if not wait:
            return 202, job.info()
        job.done.wait()
        if job.error is not None:
            raise job.error
        assert job.image is not None
        return 201, image_info(job.image)

    def _run(self, job: ImageJob, work: Work, scratch: Path | None) -> None:
        error: ApiError | None = None
        image: GuestImage | None = None
        try:
            image = work(job.report)
        except ImageError as err:
            # A step of the definition failed (an unknown package, a requirement with no
            # wheel, an unreachable registry): the request's content, not the daemon.
            error = Unprocessable(f"image {job.kind} {job.name!r} failed: {err}")
        except Exception as err:  # the job reports it; the daemon serves on
            from vmfork.image.kernel import KernelBuildError

            log.exception("image %s %s failed", job.kind, job.name)
            if isinstance(err, KernelBuildError):
                error = Unprocessable(f"image {job.kind} {job.name!r} failed: {err}")
            else:
                error = InternalError(f"image {job.kind} {job.name!r} failed: "
                                      f"{type(err).__name__}: {err}; see the daemon log")
        finally:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
        finished = time.time()
        outcome = "failed" if error is not None else "ok"
        self.metrics.image_builds.inc(kind=job.kind, outcome=outcome)
        self.metrics.image_build_seconds.observe(finished - job.started_at, kind=job.kind,
                                                 outcome=outcome)
        with job.lock:
            job.status, job.error, job.image = (FAILED if error else READY), error, image
            job.finished_at = finished
        if error is not None:
            job.report("failed", error.message)
            log.warning("%s", error.message)
        with self._lock:
            self._running.pop(job.name, None)
            self._threads.pop(job.name, None)
            self._finished[job.name] = job
            while len(self._finished) > MAX_FINISHED_JOBS:
                self._finished.popitem(last=False)
        job.done.set()

    # -- removing -------------------------------------------------------------------

    def delete(self, name: str) -> None:
        """Remove image ``name``'s record (409 while building or while snapshots use it)
        and forget its failed build, if any."""
        from vmfork.image.builder import ImageInUse, remove_image

        with self._lock:
            if name in self._running:
                raise Conflict(f"image {name!r} is being built; wait until it is ready or "
                               "failed, then delete it")
            job = self._finished.get(name)
        users = self.users(name)
        try:
            remove_image(name, users)
        except ImageInUse as err:
            raise Conflict(str(err), extra={"snapshots": err.tags}) from err
        except ImageMissing as err:
            with self._lock:
                forgotten = self._finished.pop(name, None) is not None
            if forgotten:
                return
            raise NotFound(f"no image {name!r}; GET /v1/images lists them") from err
        except ImageError as err:
            raise BadRequest(str(err)) from err
        if job is not None:
            with self._lock:
                self._finished.pop(name, None)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Say which builds the stopping daemon abandons (they die with the process;
        nothing half-built is recorded)."""
        with self._lock:
            threads = dict(self._threads)
        deadline = time.monotonic() + timeout_s
        for name, thread in threads.items():
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                log.warning("image build %s abandoned: the daemon is stopping", name)


def _iso(unix: float) -> str:
    # The image record's ``created`` format (whole seconds, UTC), so the two compare.
    return datetime.fromtimestamp(int(unix), UTC).isoformat()


def _newer(record: dict[str, Any] | None, job: ImageJob) -> bool:
    """Whether ``record`` was written after ``job`` started (built again since, e.g. by
    the CLI): then the record, not the job's failure, is the name's state."""
    return record is not None and str(record["created"]) > _iso(job.started_at)
