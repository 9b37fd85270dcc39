"""An image build's ``--run CMD`` steps (a Dockerfile ``RUN``): a command run in a build
VM, its file-system changes becoming the image's next layer.

For each step, in order, on top of the image built so far:

1. a **build VM** boots from that image (kernel word ``vmfork.build=1``: its ``/init``
   keeps the root overlay's tmpfs reachable), in a process of its own
   (``python -m vmfork.image.buildrun REQUEST RESULT``, as a parent's is), with a
   **network**: a namespace of its own under the step's egress policy (the same
   policies as ``vmfork snapshot --network --egress``), made here and removed after;
2. the agent runs CMD (``/bin/sh -c``, the image's env/workdir/user); a non-zero exit
   fails the build with the exit status and the tail of CMD's stderr;
3. the agent streams the overlay's **upper directory** as an OCI layer tar
   (``agent/upper.py``: whiteouts and opaque directories as OCI marks them, modes,
   owners, symlinks and hard links kept), at most ``MAX_LAYER_BYTES``;
4. the VM is shut down; the disk before the first step is unpacked, the earlier steps'
   layers and this one applied by the layer code that applies OCI images' layers
   (``layers.LayerApplier``: hostile members refused as for any image), and the tree
   made a disk again. The layer is kept in the step's cache entry (the next steps
   apply it: unpacking a disk loses hard links, a layer keeps them).

**Cached by content**: a step's key is the base disk's SHA-256 (which covers the
definition and every earlier step), the command and its egress policy, so a rebuild
with the same steps reuses the layer's disk (``disk-builds/<key>/``) and says so.
Built in a temporary directory and renamed into place (``cache.cached_entry``): a
failed step leaves no disk, and the caller records no image; the VM, its process, its
namespace and its files are gone whatever happened.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from vmfork.image import DISK_FILE, GuestImage
from vmfork.image.cache import cached_entry, hash_inputs
from vmfork.image.errors import ImageBuildError
from vmfork.runtime.supervise import run_module_in_own_group

RUN_RECIPE_VERSION = "2"
LAYER_FILE = "layer.tar"         # a step's changes, kept: later steps' trees apply it
BUILD_KERNEL_WORD = "vmfork.build=1"
DEFAULT_RUN_MEM_MIB = 1024
RUN_TIMEOUT_S = 3600.0
MAX_LAYER_BYTES = 8 << 30
MAX_LAYER_MEMBERS = 1_000_000
STDERR_TAIL = 2000
# The build VMs' networks: a prefix and subnet of their own, so they never meet a
# daemon's or the CLI's snapshot networks (each start-up removes its own prefix's).
NETWORK_PREFIX = "vmfb"
NETWORK_SUBNET = "10.202.0.0/24"

Progress = Callable[[str, str], None]
_SOURCES = tuple(Path(__file__).resolve().parent / n for n in ("buildrun.py", "layers.py")) \
    + (Path(__file__).resolve().parents[1] / "agent" / "upper.py",)


class RunStepFailed(ImageBuildError):
    """A ``--run`` command exited non-zero (or its VM failed); nothing was recorded."""


def step_key(base_disk_key: str, command: str, egress: str | None) -> str:
    return hash_inputs([f"run step recipe {RUN_RECIPE_VERSION}", *_SOURCES,
                        f"base disk {base_disk_key}", f"egress {egress or 'allow'}",
                        b"command", command.encode()])


def run_step(image: GuestImage, index: int, command: str, *, egress: str | None,
             first_disk: Path, prior_layers: list[Path], mem_mib: int = DEFAULT_RUN_MEM_MIB,
             timeout: float = RUN_TIMEOUT_S,
             progress: Progress) -> tuple[Path, dict[str, Any], bool]:
    """Run ``command`` on top of ``image`` (a disk-rooted image, recorded or not) and
    return ``(cache entry, manifest, built now)``: the entry holds the new disk and the
    step's layer (``LAYER_FILE``).

    The new disk's tree is made from ``first_disk`` (the disk before any run step) with
    ``prior_layers`` (the earlier steps' layers) and this step's applied in order,
    rather than from ``image``'s disk: unpacking a disk (``fsck.erofs --extract``)
    loses hard links, which the layers keep."""
    assert image.disk_key is not None and image.disk is not None
    label = f"run #{index + 1}"
    key = step_key(image.disk_key, command, egress)
    entry, built = cached_entry("disk-builds", key, lambda out: _build_step(
        out, image, label, command, egress, mem_mib, timeout, progress, first_disk,
        prior_layers))
    manifest = json.loads((entry / "manifest.json").read_text())
    if not built:
        layer = manifest["layer"]
        progress("run", f"{label}: cached, layer {layer['bytes'] >> 10} KiB "
                        f"({layer['members']} entries) reused: {_short(command)}")
    return entry, manifest, built


def _short(command: str) -> str:
    return command if len(command) <= 80 else command[:77] + "..."


def _build_step(out: Path, image: GuestImage, label: str, command: str, egress: str | None,
                mem_mib: int, timeout: float, progress: Progress, first_disk: Path,
                prior_layers: list[Path]) -> None:
    from vmfork.image.builder import _extract_disk, _tree_bytes, disk_content_key, make_disk
    from vmfork.image.layers import LayerApplier

    started = time.monotonic()
    progress("run", f"{label}: booting a build VM ({mem_mib} MiB, egress "
                    f"{egress or 'allow'}) for: {_short(command)}")
    layer_path = out / LAYER_FILE
    report = run_in_build_vm(image, command, layer_path, egress=egress, mem_mib=mem_mib,
                             timeout=timeout, label=label)
    ran = time.monotonic()
    progress("run", f"{label}: exit 0 in {report['exec_s']:.1f} s; layer "
                    f"{report['size'] >> 10} KiB ({report['members']} entries, "
                    f"{report['whiteouts']} deletions)")
    root = Path(tempfile.mkdtemp(prefix=".root-", dir=out.parent))
    try:
        _extract_disk(first_disk, image.disk_format, root)
        with LayerApplier(root) as applier:
            for n, prior in enumerate(prior_layers, 1):
                with open(prior, "rb") as layer:
                    applier.apply(layer, f"the changes of run #{n}")
            with open(layer_path, "rb") as layer:
                diff_id = applier.apply(layer, f"the changes of {label}")
        tree_bytes = _tree_bytes(root)
        fmt = image.disk_format or "erofs"
        make_disk(root, out / DISK_FILE, fmt)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    os.chmod(layer_path, 0o444)
    disk_bytes = (out / DISK_FILE).stat().st_size
    total = round(time.monotonic() - started, 3)
    manifest = {"recipe_version": RUN_RECIPE_VERSION, "root": "disk", "command": command,
                "egress": egress or "allow", "base_disk": image.disk_key,
                "content_key": disk_content_key(out / DISK_FILE),
                "layer": {"diff_id": diff_id, "bytes": report["size"],
                          "members": report["members"], "file_bytes": report["file_bytes"],
                          "whiteouts": report["whiteouts"],
                          "opaque_dirs": report["opaque_dirs"]},
                "tree_bytes": tree_bytes, "disk_bytes": disk_bytes, "disk_format": fmt,
                "env": list(image.env), "workdir": image.workdir, "user": image.user,
                "agent_python": image.agent_python,
                "step_seconds": {"vm": round(ran - started, 3), "boot": report["boot_s"],
                                 "exec": report["exec_s"],
                                 "disk": round(time.monotonic() - ran, 3)},
                "build_seconds": total}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    (out / "build-seconds").write_text(f"{total:.1f}\n")
    progress("run", f"{label}: {disk_bytes >> 20} MiB disk in {total:.1f} s")


# -- the build VM, in a process of its own ---------------------------------------------


def egress_policy(policy: str | None) -> Any:
    """``allow``, ``deny`` or a comma-separated allow-list of CIDRs and domain names
    (as ``vmfork snapshot --egress`` takes it) as an ``EgressPolicy``; ValueError if bad."""
    import ipaddress

    from vmfork.runtime.network import EgressPolicy
    if policy is None or policy == "allow":
        return EgressPolicy("allow")
    if policy == "deny":
        return EgressPolicy("deny")
    cidrs, domains = [], []
    for entry in (e.strip() for e in policy.split(",")):
        if not entry:
            continue
        try:
            ipaddress.IPv4Network(entry, strict=False)
            cidrs.append(entry)
        except ValueError:
            domains.append(entry)
    if not cidrs and not domains:
        raise ValueError("the egress policy is empty: give allow, deny or an allow-list")
    return EgressPolicy("allowlist", tuple(cidrs), tuple(domains))


@contextmanager
def _build_network(egress: str | None) -> Iterator[tuple[str, str, tuple[str, ...]]]:
    """``(netns, tap, dns)`` of a network for one build VM, removed afterwards. Builds
    take one lock, so two never claim the same namespace (one build VM at a time on a
    host); whatever carries the prefix when it is taken is a killed build's leftover
    and is removed first."""
    import fcntl

    from vmfork.paths import run_dir
    from vmfork.runtime.network import HostNetwork, NetworkError, cleanup_stale
    from vmfork.runtime.parent import guest_network
    try:
        policy = egress_policy(egress)
    except ValueError as err:
        raise ImageBuildError("run", f"egress: {err}") from err
    if os.geteuid() != 0:
        raise ImageBuildError("run", "a --run step's build VM needs a network, which needs "
                                     "root (network namespaces, nftables): build as root")
    base = run_dir()
    base.mkdir(parents=True, exist_ok=True, mode=0o700)
    lock = os.open(base / "build-network.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            cleanup_stale(NETWORK_PREFIX)
            host = HostNetwork(guest_network(), prefix=NETWORK_PREFIX, subnet=NETWORK_SUBNET,
                               workers=1)
            host.setup()
        except (NetworkError, OSError) as err:
            raise ImageBuildError("run", f"cannot make the build VM's network: {err}") \
                from err
        try:
            try:
                child = host.create(policy)
            except NetworkError as err:
                raise ImageBuildError("run", f"cannot make the build VM's network: {err}") \
                    from err
            try:
                yield child.netns, child.tap, tuple(host.guest.dns)
            finally:
                host.destroy(child)
        finally:
            # The table first: close() stops the workers that run on the host's side.
            try:
                host.remove_host_table()
            finally:
                host.close()
    finally:
        os.close(lock)


def run_in_build_vm(image: GuestImage, command: str, layer_path: Path, *,
                    egress: str | None, mem_mib: int, timeout: float,
                    label: str = "run") -> dict[str, Any]:
    """Boot a build VM from ``image`` with a network, run ``command``, stream its
    changes to ``layer_path``; returns the agent's counts with ``boot_s``/``exec_s``.
    ``RunStepFailed`` when the command exits non-zero or the VM fails."""
    from vmfork.paths import run_dir
    base = run_dir()
    base.mkdir(parents=True, exist_ok=True, mode=0o700)
    work = Path(tempfile.mkdtemp(prefix="build-", dir=base))
    try:
        with _build_network(egress) as (netns, tap, dns):
            request = {"image": image.to_record(), "cache": str(image.kernel.parents[2]),
                       "command": command, "layer": str(layer_path), "mem_mib": mem_mib,
                       "timeout": timeout, "netns": netns, "tap": tap, "dns": list(dns),
                       "max_bytes": MAX_LAYER_BYTES, "max_members": MAX_LAYER_MEMBERS}
            outcome = _run_process(work, request, timeout + 900.0, label)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if outcome["ok"]:
        return dict(outcome["result"])
    layer_path.unlink(missing_ok=True)
    message = f"{label} `{_short(command)}`: {outcome['message']}"
    if outcome.get("kind") == "command" and (egress or "allow") != "allow":
        from vmfork.runtime.parent import egress_hint
        message += f" ({egress_hint(egress_policy(egress))})"
    raise RunStepFailed("run", message)


def _run_process(work: Path, request: dict[str, Any], timeout: float,
                 label: str) -> dict[str, Any]:
    request_path, result_path = work / "request.json", work / "result.json"
    request_path.write_text(json.dumps(request))
    log_path = work / "vm.log"
    src = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (src, os.environ.get("PYTHONPATH")) if p))
    with open(log_path, "ab") as log:
        # Its own session, so a timeout kills the process and anything it started.
        try:
            status = run_module_in_own_group("vmfork.image.buildrun",
                                             [str(request_path), str(result_path)],
                                             output=log, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            raise RunStepFailed("run", f"{label}: the build VM was not done after "
                                       f"{timeout:.0f} s") from None
    try:
        return dict(json.loads(result_path.read_text()))
    except (OSError, ValueError):
        tail = log_path.read_bytes()[-STDERR_TAIL:].decode("utf-8", "replace").strip()
        last = tail.splitlines()[-1] if tail else "no output"
        how = f"was killed by signal {-status}" if status < 0 else f"exited with {status}"
        raise RunStepFailed("run", f"{label}: the build VM's process {how} before it "
                                   f"reported a result: {last}") from None


def _write_result(path: str, doc: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.rename(tmp, path)


def _process_main(request_path: str, result_path: str) -> int:
    """The build VM's process: enter the namespace, boot, run, export, report."""
    with open(request_path) as f:
        req = json.load(f)
    try:
        from vmfork.runtime.network import enter_netns
        # Before any thread exists: the VMM's threads inherit the namespace.
        enter_netns(req["netns"])
        from vmfork.runtime.guest import BootedGuest
        from vmfork.runtime.network import GuestNetwork
        from vmfork.runtime.parent import PARENT_READY_TIMEOUT_S, out_of_memory_hint

        image = GuestImage.from_record(req["image"], Path(req["cache"]))
        image = dataclasses.replace(image, cmdline=f"{image.cmdline} {BUILD_KERNEL_WORD}")
        started = time.monotonic()
        with BootedGuest(image, mem_mib=req["mem_mib"], network=GuestNetwork(
                dns=tuple(req["dns"])), net_tap=req["tap"],
                ready_timeout=PARENT_READY_TIMEOUT_S) as guest:
            booted = time.monotonic()

            # The command's output goes to this process's log; only the tail of its
            # stderr is kept (a chatty command's whole output could be any size).
            stderr_tail = bytearray()

            def echo(chunk: bytes) -> None:
                sys.stderr.buffer.write(chunk)
                sys.stderr.buffer.flush()

            def keep_tail(chunk: bytes) -> None:
                echo(chunk)
                stderr_tail.extend(chunk)
                del stderr_tail[:-4 * STDERR_TAIL]

            done = guest.agent.exec(req["command"], timeout=req["timeout"],
                                    on_stdout=echo, on_stderr=keep_tail, capture=False)
            ran = time.monotonic()
            if done.exit_code != 0:
                tail = stderr_tail.decode("utf-8", "replace").strip()[-STDERR_TAIL:]
                message = f"exited {done.exit_code}" + (f":\n{tail}" if tail else "")
                hint = out_of_memory_hint(guest.console_tail(), req["mem_mib"], tail)
                if hint is not None:
                    message += f"\n({hint})"
                _write_result(result_path, {"ok": False, "kind": "command",
                                            "exit_code": done.exit_code, "message": message})
                return 0
            with open(req["layer"], "wb") as layer:
                counts = guest.agent.export_upper(layer, max_bytes=req["max_bytes"],
                                                  max_members=req["max_members"])
    except Exception as err:  # noqa: BLE001 - every failure becomes a typed result
        import traceback
        traceback.print_exc()
        _write_result(result_path, {"ok": False, "kind": "vm",
                                    "message": f"{type(err).__name__}: {err}"})
        return 0
    _write_result(result_path, {"ok": True, "result": {
        **{k: counts[k] for k in ("size", "members", "file_bytes", "whiteouts",
                                  "opaque_dirs")},
        "boot_s": round(booted - started, 3), "exec_s": round(ran - booted, 3)}})
    return 0


if __name__ == "__main__":
    sys.exit(_process_main(sys.argv[1], sys.argv[2]))
