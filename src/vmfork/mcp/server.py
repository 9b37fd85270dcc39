"""The MCP tools: forkd-mcp's eleven (same names and parameters) plus files,
snapshot details and guest images, each a thin call through the Python SDK
(``vmfork.client``).

The server holds no state of its own: every call asks the daemon, which owns
the sandboxes, so an MCP client, the CLI and SDK scripts see the same world.

Arguments are checked twice. Their JSON schema (from the annotations below)
already carries the patterns and bounds, so the model sees them and the MCP SDK
refuses a call that breaks them; the daemon checks everything again. Nothing
here goes through a shell: guest paths travel as query parameters of the files
API or as separate argv entries, never inside a command string (forkd-mcp's
``wait_for_text`` interpolated the path into ``sh -c``).

Failures the caller can act on (the daemon's 4xx/5xx with its reason, an
unreachable daemon, a timeout) become ``ToolError``: the model reads the
reason as the tool result, with ``isError`` set.
"""

from __future__ import annotations

import base64
import binascii
import threading
import time
from typing import Annotated, Any, Literal

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import Field

from vmfork import __version__
from vmfork.client import Controller, ControllerError, ImageInfo

NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
MAX_TRANSFER_WAIT = 600.0   # seconds a push_snapshot/pull_snapshot call waits for its job
# Absolute, no NUL; the daemon's own check (check_guest_path) is the authority.
GUEST_PATH_PATTERN = r"^/[^\x00]{0,4095}$"
READ_LIMIT_DEFAULT = 1 << 20
READ_LIMIT_MAX = 16 << 20
EXCERPT_BYTES = 4096
PROCESS_OUTPUT_SHOWN = 64 << 10
# An image build's progress, as a tool returns it: the last lines are what tell a model
# where a build is or why it failed; the daemon keeps 200.
PROGRESS_SHOWN = 20

SandboxId = Annotated[str, Field(pattern=NAME_PATTERN, description=(
    "Sandbox id, as returned by spawn_sandboxes or list_sandboxes."))]
SnapshotTag = Annotated[str, Field(pattern=NAME_PATTERN, description=(
    "Snapshot tag: 1-64 letters, digits, '-' or '_'."))]
ImageName = Annotated[str, Field(pattern=NAME_PATTERN, description=(
    "Image name: 1-64 letters, digits, '-' or '_'."))]
Packages = Annotated[list[str], Field(max_length=512)]
GuestPath = Annotated[str, Field(pattern=GUEST_PATH_PATTERN, description=(
    "Absolute path inside the sandbox, e.g. /tmp/out.txt. Taken literally (no shell, "
    "no globbing, no ~)."))]

INSTRUCTIONS = """\
vmfork runs code in microVM sandboxes forked copy-on-write from warm snapshots, so a new
sandbox starts in milliseconds with its imports and state already loaded.

Typical flow: list_snapshots to pick a snapshot (or create_snapshot to make one, which
takes a while), spawn_sandboxes to get sandbox ids, then exec_command (programs) or
eval_code (Python in the sandbox's already-warm interpreter: fastest), read_file /
write_file / list_files for files. branch_sandbox snapshots a running sandbox so that
later spawn_sandboxes calls start from exactly that state (fan out from a checkpoint).
Always kill_sandbox what you spawned when you are done: sandboxes run until killed, unless
spawned with timeout_secs (then killed, or paused with on_timeout="pause", at the end;
set_sandbox_timeout moves it). pause_sandbox keeps a sandbox (files, processes) without
running it; resume_sandbox brings it back under the same id.

Sandboxes need other software than the default image has? build_image makes an image
(Debian packages, Python wheels, npm packages, files, environment), then create_snapshot
with image=<its name> boots it and saves a snapshot to spawn from.
"""


def build_server(controller: Controller) -> MCPServer:
    """An MCP server whose tools drive the daemon behind ``controller``."""
    server: MCPServer = MCPServer("vmfork", version=__version__, instructions=INSTRUCTIONS)
    tools = _Tools(controller)
    for fn in (tools.list_snapshots, tools.snapshot_info, tools.create_snapshot,
               tools.compact_snapshot, tools.push_snapshot, tools.pull_snapshot,
               tools.transfer_status,
               tools.spawn_sandboxes, tools.list_sandboxes, tools.get_sandbox,
               tools.kill_sandbox, tools.ping_sandbox, tools.exec_command, tools.eval_code,
               tools.branch_sandbox, tools.wait_for_text, tools.read_file, tools.write_file,
               tools.list_files, tools.list_images, tools.get_image, tools.build_image,
               tools.delete_image, tools.start_process, tools.list_processes,
               tools.read_process_output, tools.send_process_input, tools.kill_process,
               tools.set_sandbox_timeout, tools.pause_sandbox, tools.resume_sandbox,
               tools.sandbox_metrics):
        server.add_tool(fn)
    return server


def _tool_error(err: ControllerError, action: str) -> ToolError:
    """The daemon's reason, plus the output so far when a command timed out."""
    body = err.body if isinstance(err.body, dict) else {}
    where = "the vmfork daemon is unreachable" if err.status == 0 else f"HTTP {err.status}"
    text = f"{action} failed ({where}): {err.message}"
    for stream in ("stdout", "stderr"):
        if body.get(stream):
            text += f"\n{stream} so far:\n{str(body[stream])[-2000:]}"
    return ToolError(text)


class _BoundedSink:
    """The file object ``read_file_to`` writes into; stops the transfer at ``limit``."""

    class Full(Exception):
        pass

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.chunks: list[bytes] = []
        self.size = 0

    def write(self, data: bytes) -> int:
        room = self.limit - self.size
        self.chunks.append(bytes(data[:room]))
        self.size += min(len(data), room)
        if len(data) > room:
            raise self.Full
        return len(data)


class _Tools:
    """One method per tool; the docstrings are what the model reads."""

    def __init__(self, controller: Controller) -> None:
        self.c = controller

    # -- snapshots ------------------------------------------------------------------

    def list_snapshots(self) -> list[dict[str, Any]]:
        """List the snapshots sandboxes can be spawned from.

        Each has a tag (pass it to spawn_sandboxes), a status (only "ready" ones can be
        spawned from; "writing" means a branch is still being saved), and where it came
        from (branched_from for snapshots made by branch_sandbox).
        """
        try:
            return self.c.list_snapshots()
        except ControllerError as err:
            raise _tool_error(err, "list_snapshots") from None

    def snapshot_info(self, tag: SnapshotTag) -> dict[str, Any]:
        """Details of one snapshot: memory size on disk (logical and physical bytes), its
        parent and ancestors if it was branched, and the snapshots that depend on it."""
        try:
            return self.c.snapshot_info(tag)
        except ControllerError as err:
            raise _tool_error(err, f"snapshot_info {tag}") from None

    def compact_snapshot(
        self,
        tag: SnapshotTag,
        to: Annotated[str, Field(pattern=NAME_PATTERN, description=(
            "Tag for the new flat snapshot: 1-64 letters, digits, '-' or '_'; "
            "must not exist yet."))],
    ) -> dict[str, Any]:
        """Copy snapshot `tag` and the chain of branches under it into one new flat
        snapshot `to`, which no longer depends on its ancestors (they can then be
        deleted). Spawning is as fast either way; use this before deleting the base a
        branch was made from, or to ship one self-contained snapshot. Returns the new
        snapshot's details."""
        try:
            return self.c.compact_snapshot(tag, to)
        except ControllerError as err:
            raise _tool_error(err, f"compact_snapshot {tag} -> {to}") from None

    def _waited(self, job: dict[str, Any], wait: bool) -> dict[str, Any]:
        return self.c.wait_transfer(job["id"], timeout=MAX_TRANSFER_WAIT) if wait else job

    def push_snapshot(
        self,
        tag: SnapshotTag,
        ref: Annotated[str, Field(max_length=512, description=(
            "Where to: HOST[:PORT]/REPO[:TAG] of an OCI registry (the registry tag "
            "defaults to the snapshot's). Credentials come from the daemon host's Docker "
            "config file."))],
        sign_key: Annotated[str | None, Field(description=(
            "An Ed25519 private key (PEM) on the daemon's host to sign it with."))] = None,
        wait: Annotated[bool, Field(description=(
            f"Wait (up to {MAX_TRANSFER_WAIT:.0f} s) for the push to finish; otherwise "
            "return the job at once, for transfer_status."))] = True,
    ) -> dict[str, Any]:
        """Push snapshot `tag` with its whole chain (and guest image) to an OCI registry,
        so another host can pull_snapshot it. Only what the registry lacks is sent.
        Returns the job: status done/failed/running, progress, and the result (the
        manifest digest, blobs uploaded and already present) or error."""
        try:
            return self._waited(self.c.push_snapshot(tag, ref, sign_key=sign_key), wait)
        except ControllerError as err:
            raise _tool_error(err, f"push_snapshot {tag} -> {ref}") from None

    def pull_snapshot(
        self,
        ref: Annotated[str, Field(max_length=512, description=(
            "What: HOST[:PORT]/REPO[:TAG|@sha256:HEX] of a snapshot pushed by vmfork."))],
        tag: Annotated[str | None, Field(pattern=NAME_PATTERN, description=(
            "Store the chain's head under this tag (default: the tag it was pushed "
            "with)."))] = None,
        verify_key: Annotated[str | None, Field(description=(
            "An Ed25519 public key (PEM) on the daemon's host: refuse the snapshot "
            "unless it is signed by it."))] = None,
        wait: Annotated[bool, Field(description=(
            f"Wait (up to {MAX_TRANSFER_WAIT:.0f} s) for the pull to finish."))] = True,
    ) -> dict[str, Any]:
        """Pull a snapshot chain from an OCI registry into the daemon's store (every
        blob verified; what is already here is skipped), then spawn_sandboxes from it.
        Returns the job, with the stored tags in its result once done."""
        try:
            return self._waited(self.c.pull_snapshot(ref, tag=tag, verify_key=verify_key),
                                wait)
        except ControllerError as err:
            raise _tool_error(err, f"pull_snapshot {ref}") from None

    def transfer_status(
        self,
        job_id: Annotated[str, Field(pattern=r"^[0-9a-f]{16}$", description=(
            "The id push_snapshot or pull_snapshot returned."))],
    ) -> dict[str, Any]:
        """The status of a push or pull: running (with bytes done of total), done (with
        its result) or failed (with the reason)."""
        try:
            return self.c.get_transfer(job_id)
        except ControllerError as err:
            raise _tool_error(err, f"transfer_status {job_id}") from None

    def create_snapshot(
        self,
        tag: SnapshotTag,
        kernel: Annotated[str | None, Field(description=(
            "forkd's form: a vmlinux (uncompressed x86-64 ELF) on the daemon's host, "
            "booted with rootfs instead of an image; unset to boot an image."))] = None,
        rootfs: Annotated[str | None, Field(description=(
            "forkd's form, with kernel: an ext4, squashfs or erofs image on the daemon's "
            "host, mounted read-only as the guest's root under a RAM overlay; it needs "
            "a python3 (3.9+) for vmfork's agent."))] = None,
        rw: Annotated[bool, Field(description=(
            "forkd compatibility; the root is always writable in guest RAM and never "
            "written on the host."))] = False,
        tap: Annotated[str | None, Field(description=(
            "forkd compatibility only; refused: vmfork makes its own networks."))] = None,
        boot_wait_secs: Annotated[float, Field(ge=0, le=60, description=(
            "forkd compatibility only; ignored: vmfork snapshots as soon as the guest "
            "answers and the warm-up has run."))] = 10,
        image: Annotated[str, Field(min_length=1, max_length=255, description=(
            "Guest image to boot (default 'default')."))] = "default",
        mem_mib: Annotated[int, Field(ge=64, le=65536, description=(
            "Guest memory in MiB."))] = 256,
        vcpus: Annotated[int, Field(ge=1, le=64)] = 1,
        warm_code: Annotated[str | None, Field(description=(
            "Python to run in the guest's interpreter before the snapshot, e.g. "
            "'import numpy'; every sandbox spawned from it starts with this done."))] = None,
        warm_cmd: Annotated[str | None, Field(description=(
            "Shell command to run in the guest before the snapshot."))] = None,
        volumes: Annotated[list[str] | None, Field(max_length=24, description=(
            "Read-only volumes, each 'SRC:GUEST_PATH' (SRC an absolute directory or image "
            "file on the daemon's host), mounted before the warm-up and in every "
            "sandbox of the snapshot."))] = None,
        volume_slots: Annotated[int | None, Field(ge=0, le=24, description=(
            "Empty volume slots to reserve for volumes given to spawn_sandboxes "
            "(default 4)."))] = None,
    ) -> dict[str, Any]:
        """Boot a fresh VM, warm it (warm_code / warm_cmd), and save it as snapshot `tag`.

        Slow (tens of seconds or more): prefer an existing snapshot from list_snapshots,
        or branch_sandbox to checkpoint a sandbox that is already set up. Returns the
        snapshot's info once it is ready.
        """
        if tap is not None:
            raise ToolError("create_snapshot: vmfork takes no host tap; it gives each "
                            "parent and sandbox a network namespace of its own")
        try:
            return self.c.create_snapshot(tag, image=image, mem_mib=mem_mib, vcpus=vcpus,
                                          warm_code=warm_code, warm_cmd=warm_cmd,
                                          kernel=kernel, rootfs=rootfs,
                                          volumes=volumes, volume_slots=volume_slots)
        except ControllerError as err:
            raise _tool_error(err, f"create_snapshot {tag}") from None

    # -- sandboxes ------------------------------------------------------------------

    def spawn_sandboxes(
        self,
        snapshot_tag: SnapshotTag,
        n: Annotated[int, Field(ge=1, le=1000, description=(
            "How many sandboxes to fork (1-1000); each is an independent VM."))] = 1,
        per_child_netns: Annotated[bool, Field(description=(
            "Give each sandbox its own network namespace (refused where the daemon has "
            "no networking)."))] = False,
        memory_limit_mib: Annotated[int | None, Field(ge=16, description=(
            "Memory limit of each sandbox in MiB; unset for none."))] = None,
        prewarm: bool = False,
        live_fork: Annotated[bool, Field(description=(
            "forkd's live-branch mode (refused where unsupported)."))] = False,
        volumes: Annotated[list[str] | None, Field(max_length=24, description=(
            "Volumes to attach, each 'SRC:GUEST_PATH[:ro|:rw]' (SRC an absolute directory "
            "or image file on the daemon's host; read-only unless ':rw', which needs an "
            "image file, n=1, and is refused while another sandbox holds it)."))] = None,
        timeout_secs: Annotated[float | None, Field(ge=1, le=30 * 86400, description=(
            "Lifetime in seconds: then the sandbox is killed (or paused, on_timeout="
            "'pause'). Unset: it runs until killed."))] = None,
        on_timeout: Literal["kill", "pause"] = "kill",
        metadata: Annotated[dict[str, str] | None, Field(max_length=64, description=(
            "Labels to find the sandboxes by with list_sandboxes (keys 1-128, values up to "
            "1024 characters)."))] = None,
        envs: Annotated[dict[str, str] | None, Field(max_length=256, description=(
            "Environment variables every command in the sandboxes gets."))] = None,
    ) -> list[dict[str, Any]]:
        """Fork n new sandboxes from a ready snapshot. Each starts in the snapshot's exact
        state (imports done, variables set) and is independent from then on.

        Returns one record per sandbox; use its id with exec_command, eval_code, the file
        tools, branch_sandbox and kill_sandbox. Sandboxes run until killed (or until
        timeout_secs, if given).
        """
        try:
            return self.c.spawn_sandboxes(snapshot_tag, n, per_child_netns=per_child_netns,
                                          memory_limit_mib=memory_limit_mib, prewarm=prewarm,
                                          live_fork=live_fork, volumes=volumes,
                                          timeout_secs=timeout_secs, on_timeout=on_timeout,
                                          metadata=metadata, envs=envs)
        except ControllerError as err:
            raise _tool_error(err, f"spawn_sandboxes from {snapshot_tag}") from None

    def list_sandboxes(
        self,
        metadata: Annotated[dict[str, str] | None, Field(max_length=64, description=(
            "Only sandboxes whose metadata has every one of these pairs."))] = None,
        state: Annotated[list[Literal["running", "paused", "exited", "lost"]] | None,
                         Field(max_length=4, description="Only sandboxes in these states."
                               )] = None,
    ) -> list[dict[str, Any]]:
        """List the sandboxes the daemon runs (id, snapshot_tag, status, pid, metadata,
        end_at_unix, ...)."""
        try:
            return self.c.list_sandboxes(metadata=metadata, state=state)
        except ControllerError as err:
            raise _tool_error(err, "list_sandboxes") from None

    def set_sandbox_timeout(
        self,
        sandbox_id: SandboxId,
        timeout_secs: Annotated[float | None, Field(ge=1, le=30 * 86400, description=(
            "Seconds from now until the sandbox ends (killed, or paused if spawned with "
            "on_timeout='pause'); null: never."))],
    ) -> dict[str, Any]:
        """Extend (or shorten, or clear) a running sandbox's lifetime; returns its record
        with the new end_at_unix."""
        try:
            return self.c.set_timeout(sandbox_id, timeout_secs)
        except ControllerError as err:
            raise _tool_error(err, f"set_sandbox_timeout {sandbox_id}") from None

    def pause_sandbox(self, sandbox_id: SandboxId) -> dict[str, Any]:
        """Pause a sandbox: its whole state (memory, files, running processes) is saved and
        it stops using CPU and memory. resume_sandbox brings it back with the same id."""
        try:
            return self.c.pause_sandbox(sandbox_id)
        except ControllerError as err:
            raise _tool_error(err, f"pause_sandbox {sandbox_id}") from None

    def resume_sandbox(
        self,
        sandbox_id: SandboxId,
        timeout_secs: Annotated[float | None, Field(ge=1, le=30 * 86400, description=(
            "Its lifetime from now; unset: the one it had."))] = None,
    ) -> dict[str, Any]:
        """Resume a paused sandbox under the same id, exactly as it was paused (processes
        go on running)."""
        try:
            return self.c.resume_sandbox(sandbox_id, timeout_secs)
        except ControllerError as err:
            raise _tool_error(err, f"resume_sandbox {sandbox_id}") from None

    def sandbox_metrics(self, sandbox_id: SandboxId) -> dict[str, Any]:
        """What a running sandbox uses now: CPU seconds, memory (bytes) and disk use of its
        root file system (bytes)."""
        try:
            return self.c.sandbox_metrics(sandbox_id)
        except ControllerError as err:
            raise _tool_error(err, f"sandbox_metrics {sandbox_id}") from None

    def get_sandbox(self, sandbox_id: SandboxId) -> dict[str, Any]:
        """One sandbox's record: status (running/exited/lost), its snapshot, branch count."""
        try:
            return self.c.get_sandbox(sandbox_id)
        except ControllerError as err:
            raise _tool_error(err, f"get_sandbox {sandbox_id}") from None

    def kill_sandbox(self, sandbox_id: SandboxId) -> dict[str, Any]:
        """Stop a sandbox and free its memory. Its files and state are gone afterwards
        (branch_sandbox first to keep them)."""
        try:
            self.c.kill_sandbox(sandbox_id)
        except ControllerError as err:
            raise _tool_error(err, f"kill_sandbox {sandbox_id}") from None
        return {"id": sandbox_id, "killed": True}

    def ping_sandbox(self, sandbox_id: SandboxId) -> dict[str, Any]:
        """Check that a sandbox's guest agent answers; returns its pid, version and uptime."""
        try:
            return self.c.ping_sandbox(sandbox_id)
        except ControllerError as err:
            raise _tool_error(err, f"ping_sandbox {sandbox_id}") from None

    def exec_command(
        self,
        sandbox_id: SandboxId,
        args: Annotated[list[str], Field(min_length=1, description=(
            "The program and its arguments, e.g. [\"python3\", \"-c\", \"print(2+2)\"]. "
            "Not run through a shell: for pipes or redirections pass "
            "[\"/bin/sh\", \"-c\", \"...\"]."))],
        timeout_secs: Annotated[float, Field(gt=0, le=86400, description=(
            "Seconds before the command is killed."))] = 30,
        cwd: Annotated[str | None, Field(pattern=GUEST_PATH_PATTERN, description=(
            "Working directory (absolute)."))] = None,
        env: Annotated[dict[str, str] | None, Field(description=(
            "Extra environment variables."))] = None,
        stdin: Annotated[str | None, Field(description="Text fed to standard input.")] = None,
    ) -> dict[str, Any]:
        """Run a program inside a sandbox and wait for it. Returns stdout, stderr and
        exit_code (a non-zero exit_code is a normal result, not a tool error). For Python
        expressions against the warm interpreter, eval_code is much faster."""
        try:
            return self.c.exec_command(sandbox_id, args, timeout_secs, env=env, cwd=cwd,
                                       stdin=stdin)
        except ControllerError as err:
            raise _tool_error(err, f"exec_command in {sandbox_id}") from None

    def eval_code(
        self,
        sandbox_id: SandboxId,
        code: Annotated[str, Field(description=(
            "Python source. The value of a final expression is returned as result (its "
            "repr); variables persist between calls in the same sandbox."))],
        timeout_secs: Annotated[float | None, Field(gt=0, le=86400)] = None,
    ) -> dict[str, Any]:
        """Run Python in the sandbox's warm interpreter (already imported whatever the
        snapshot warmed): milliseconds instead of starting python3. Returns result,
        error (the exception, if any), exit_code, and printed stdout/stderr."""
        try:
            return self.c.eval_code(sandbox_id, code, timeout_secs)
        except ControllerError as err:
            raise _tool_error(err, f"eval_code in {sandbox_id}") from None

    def branch_sandbox(
        self,
        sandbox_id: SandboxId,
        tag: Annotated[str | None, Field(pattern=NAME_PATTERN, description=(
            "Tag for the new snapshot; the daemon names it when unset."))] = None,
        diff: Annotated[bool, Field(description=(
            "Legacy forkd flag, same as mode=\"diff\"."))] = False,
        measure_diff: Annotated[bool, Field(description=(
            "Also report what a diff snapshot would have cost (measurement only)."))] = False,
        mode: Annotated[Literal["full", "diff", "live"] | None, Field(description=(
            "\"full\" (default) saves all memory; \"diff\" only what changed since the "
            "sandbox's snapshot; \"live\" keeps the pause shortest (needs support from "
            "the daemon)."))] = None,
        wait: Annotated[bool, Field(description=(
            "false returns at once while the snapshot is still being written (status "
            "\"writing\"); poll list_snapshots until it is \"ready\"."))] = True,
    ) -> dict[str, Any]:
        """Checkpoint a running sandbox as a new snapshot. The sandbox pauses briefly and
        then runs on; spawn_sandboxes with the returned tag gives new sandboxes that
        start from exactly this moment (memory, files, variables). Use it to fan out
        several attempts from one prepared state."""
        try:
            return self.c.branch_sandbox(sandbox_id, tag=tag, diff=diff,
                                         measure_diff=measure_diff, mode=mode, wait=wait)
        except ControllerError as err:
            raise _tool_error(err, f"branch_sandbox {sandbox_id}") from None

    # -- files and waiting ----------------------------------------------------------

    def wait_for_text(
        self,
        sandbox_id: SandboxId,
        path: GuestPath,
        marker: Annotated[str, Field(min_length=1, max_length=EXCERPT_BYTES // 2)],
        timeout_secs: Annotated[float, Field(gt=0, le=3600)] = 60,
        poll_interval_ms: Annotated[int, Field(ge=10, le=60_000)] = 200,
    ) -> dict[str, Any]:
        """Wait until a file in the sandbox (say a log a background job writes) contains
        `marker`, polling its last 4 KiB. Returns found, elapsed_ms and last_excerpt (the
        end of the file, so you can see what is written when the marker never comes).
        A file that does not exist yet is waited for too."""
        started = time.monotonic()
        deadline = started + timeout_secs
        excerpt = ""
        while True:
            try:
                # tail reads the path as one argv entry: nothing is interpreted.
                r = self.c.exec_command(sandbox_id, ["tail", "-c", str(EXCERPT_BYTES), path],
                                        timeout_secs=10)
            except ControllerError as err:
                raise _tool_error(err, f"wait_for_text in {sandbox_id}") from None
            if r["exit_code"] == 0:
                excerpt = r["stdout"]
                if marker in excerpt:
                    return {"found": True, "elapsed_ms": _ms_since(started),
                            "last_excerpt": excerpt[-256:]}
            if time.monotonic() + poll_interval_ms / 1000 > deadline:
                return {"found": False, "elapsed_ms": _ms_since(started),
                        "last_excerpt": excerpt[-256:]}
            time.sleep(poll_interval_ms / 1000)

    def read_file(
        self,
        sandbox_id: SandboxId,
        path: GuestPath,
        max_bytes: Annotated[int, Field(ge=1, le=READ_LIMIT_MAX, description=(
            "Read at most this many bytes from the start of the file."))] = READ_LIMIT_DEFAULT,
    ) -> dict[str, Any]:
        """Read a file from a sandbox. Text comes back as content with encoding "utf-8";
        other bytes as base64 (encoding "base64"). truncated is true when the file is
        longer than max_bytes."""
        sink = _BoundedSink(max_bytes)
        truncated = False
        try:
            self.c.read_file_to(sandbox_id, path, sink)  # type: ignore[arg-type]
        except _BoundedSink.Full:
            truncated = True
        except ControllerError as err:
            raise _tool_error(err, f"read_file {path} in {sandbox_id}") from None
        data = b"".join(sink.chunks)
        try:
            content, encoding = data.decode("utf-8"), "utf-8"
        except UnicodeDecodeError:
            content, encoding = base64.b64encode(data).decode("ascii"), "base64"
        return {"path": path, "size": len(data), "truncated": truncated,
                "encoding": encoding, "content": content}

    def write_file(
        self,
        sandbox_id: SandboxId,
        path: GuestPath,
        content: Annotated[str, Field(description="The new contents of the file.")],
        encoding: Annotated[Literal["utf-8", "base64"], Field(description=(
            "How content is encoded: \"utf-8\" text, or \"base64\" for binary data."))] = "utf-8",
        mode: Annotated[str, Field(pattern=r"^0?[0-7]{3}$", description=(
            "Permission bits in octal, e.g. \"644\" or \"755\"."))] = "644",
        make_parents: Annotated[bool, Field(description=(
            "Create missing parent directories."))] = False,
    ) -> dict[str, Any]:
        """Create or replace a file in a sandbox (atomically: readers never see half a
        file). Returns its path and size in bytes."""
        if encoding == "base64":
            try:
                data = base64.b64decode(content, validate=True)
            except binascii.Error as err:
                raise ToolError(f"write_file: content is not valid base64: {err}") from None
        else:
            data = content.encode("utf-8")
        try:
            return self.c.write_file(sandbox_id, path, data, mode=int(mode, 8),
                                     make_parents=make_parents)
        except ControllerError as err:
            raise _tool_error(err, f"write_file {path} in {sandbox_id}") from None

    # -- guest images -----------------------------------------------------------------

    def list_images(self) -> list[dict[str, Any]]:
        """List the guest images snapshots can boot: name, status ("ready", or
        "building"/"failed" for a build), size in bytes, root ("initramfs" for the
        default image, "disk" for built ones), built_from and the definition it was built
        from (packages, copies, env)."""
        try:
            return [_image_json(i) for i in self.c.list_images()]
        except ControllerError as err:
            raise _tool_error(err, "list_images") from None

    def get_image(self, name: ImageName) -> dict[str, Any]:
        """One image, or its build: status "building" with the build's last progress
        lines, "ready" with its record, or "failed" with error (the step that failed)."""
        try:
            return _image_json(self.c.get_image(name))
        except ControllerError as err:
            raise _tool_error(err, f"get_image {name}") from None

    def build_image(
        self,
        name: ImageName,
        base: Annotated[str | None, Field(pattern=NAME_PATTERN, description=(
            "Image to start from (default: the default image, Debian with Python 3.11)."
            ))] = None,
        apt: Annotated[Packages, Field(description=(
            "Debian packages, e.g. [\"python3-numpy\", \"curl\"]; dependencies come "
            "along."))] = [],  # noqa: B006 - pydantic copies defaults; the schema shows []
        pip: Annotated[Packages, Field(description=(
            "Python requirements installed as wheels, e.g. [\"pandas==2.2.3\"]."))] = [],  # noqa: B006
        requirements: Annotated[str | None, Field(max_length=256 << 10, description=(
            "The text of a requirements.txt (requirements only, optionally with "
            "--hash)."))] = None,
        npm: Annotated[Packages, Field(description=(
            "npm packages, e.g. [\"left-pad@1.3.0\"]; run them with Debian's nodejs "
            "(add \"nodejs\" to apt)."))] = [],  # noqa: B006
        copy: Annotated[Packages, Field(description=(
            "Files or directories of the daemon's host to copy in, each \"SRC:DST\" with "
            "absolute paths, e.g. \"/srv/app:/app\"."))] = [],  # noqa: B006
        env: Annotated[dict[str, str] | None, Field(description=(
            "Environment of commands run in its sandboxes."))] = None,
        workdir: Annotated[str | None, Field(pattern=GUEST_PATH_PATTERN, description=(
            "Default working directory of commands (absolute)."))] = None,
        user: Annotated[str | None, Field(max_length=65, description=(
            "Default user of commands: NAME, UID or USER:GROUP."))] = None,
        run: Annotated[Packages, Field(description=(
            "Shell commands (a Dockerfile RUN), run in order after the rest, each in a "
            "build VM booted from the image so far with a network; what each changes in "
            "the file system becomes the image's next layer, e.g. [\"pip install "
            "requests\"]. A command exiting non-zero fails the build."))] = [],  # noqa: B006
        egress: Annotated[str | None, Field(max_length=4096, description=(
            "The run commands' network policy: allow (default), deny, or a "
            "comma-separated allow-list of CIDRs and domain names."))] = None,
        wait: Annotated[bool, Field(description=(
            "true waits until the image is ready (a cached definition takes seconds, new "
            "packages or wheels minutes); false returns at once with status \"building\": "
            "poll get_image."))] = True,
    ) -> dict[str, Any]:
        """Build a guest image: the base plus Debian packages, Python wheels, npm
        packages and files, with an environment for commands. An unchanged definition is
        reused from cache. Returns the image's record once ready (or the build, with
        wait=false); then create_snapshot with image=name boots it."""
        try:
            return _image_json(self.c.build_image(
                name, base=base, apt=apt, pip=pip, requirements=requirements, npm=npm,
                copy=copy, env=env, workdir=workdir, user=user, run=run, egress=egress,
                wait=wait))
        except ControllerError as err:
            raise _tool_error(err, f"build_image {name}") from None
        except ValueError as err:   # a copy entry that is not SRC:DST
            raise ToolError(f"build_image {name}: {err}") from None

    def delete_image(self, name: ImageName) -> dict[str, Any]:
        """Remove an image. Refused while snapshots were booted from it (the error names
        them: delete those snapshots first)."""
        try:
            self.c.delete_image(name)
        except ControllerError as err:
            raise _tool_error(err, f"delete_image {name}") from None
        return {"name": name, "deleted": True}

    def list_files(self, sandbox_id: SandboxId, path: GuestPath) -> list[dict[str, Any]]:
        """List a directory in a sandbox: name, type (file, dir, symlink, ...), size, mode
        and mtime of each entry."""
        try:
            return self.c.list_files(sandbox_id, path)
        except ControllerError as err:
            raise _tool_error(err, f"list_files {path} in {sandbox_id}") from None


    # -- background processes ------------------------------------------------------

    def start_process(
        self,
        sandbox_id: SandboxId,
        command: Annotated[str, Field(min_length=1, max_length=65536, description=(
            "A shell command line (run by /bin/sh -c), e.g. \"python3 server.py\"."))],
        stdin: Annotated[bool, Field(description=(
            "Keep its standard input open for send_process_input."))] = False,
        timeout_secs: Annotated[float | None, Field(gt=0, le=86400, description=(
            "Kill it after this many seconds (default: never)."))] = None,
        cwd: Annotated[str | None, Field(pattern=GUEST_PATH_PATTERN)] = None,
    ) -> dict[str, Any]:
        """Start a long-running program in the background (a server, a watcher, an
        interactive tool) and return at once with its pid. Read what it prints with
        read_process_output, type into it with send_process_input, stop it with
        kill_process; list_processes shows them all."""
        try:
            return self.c.start_process(sandbox_id, command, stdin=stdin, cwd=cwd,
                                        timeout_secs=timeout_secs)
        except ControllerError as err:
            raise _tool_error(err, f"start_process in {sandbox_id}") from None

    def list_processes(self, sandbox_id: SandboxId) -> list[dict[str, Any]]:
        """The sandbox's background processes: pid, argv, running, exit_code,
        output_bytes (how far read_process_output can read)."""
        try:
            return self.c.list_processes(sandbox_id)
        except ControllerError as err:
            raise _tool_error(err, f"list_processes in {sandbox_id}") from None

    def read_process_output(
        self,
        sandbox_id: SandboxId,
        pid: Annotated[int, Field(ge=1, le=1 << 22)],
        offset: Annotated[int, Field(ge=0, description=(
            "Where to start: 0, or the next_offset of the previous call."))] = 0,
        wait_secs: Annotated[float, Field(ge=0, le=600, description=(
            "How long to wait for more output (or for the end) before returning."))] = 2,
    ) -> dict[str, Any]:
        """What a background process printed from `offset` (stdout and stderr
        interleaved, at most 64 KiB per call), waiting up to wait_secs for more.
        Returns output, next_offset (pass it to the next call), running and, once it
        ended, exit_code."""
        try:
            stream = self.c.process_output(sandbox_id, pid, offset=offset,
                                           encoding="base64")
        except ControllerError as err:
            raise _tool_error(err, f"read_process_output {pid} in {sandbox_id}") from None
        chunks: list[bytes] = []
        size = 0
        next_offset = offset
        end: dict[str, Any] | None = None
        timer = threading.Timer(wait_secs, stream.close)
        timer.start()
        try:
            for event, data in stream:
                if event == "exit":
                    end = data
                    break
                if event == "error":
                    raise ToolError(f"read_process_output {pid} in {sandbox_id} failed: "
                                    f"{data.get('error')}")
                if event in ("stdout", "stderr", "pty"):
                    chunk = base64.b64decode(data["data_b64"])[:PROCESS_OUTPUT_SHOWN - size]
                    chunks.append(chunk)
                    size += len(chunk)
                    next_offset = int(data["offset"]) + len(chunk)
                    if size >= PROCESS_OUTPUT_SHOWN:
                        break
        finally:
            timer.cancel()
            stream.close()
        result: dict[str, Any] = {"output": b"".join(chunks).decode("utf-8", "replace"),
                                  "next_offset": next_offset, "running": end is None}
        if end is not None:
            result.update(exit_code=end["exit_code"], signal=end["signal"],
                          next_offset=end["offset"])
        return result

    def send_process_input(
        self,
        sandbox_id: SandboxId,
        pid: Annotated[int, Field(ge=1, le=1 << 22)],
        text: Annotated[str, Field(max_length=1 << 20, description=(
            "Text for its standard input; end lines with \\n."))],
        close: Annotated[bool, Field(description="Close its input afterwards.")] = False,
    ) -> dict[str, Any]:
        """Type into a background process started with stdin=true."""
        try:
            written = self.c.send_process_stdin(sandbox_id, pid, text.encode("utf-8"),
                                                eof=close)
        except ControllerError as err:
            raise _tool_error(err, f"send_process_input {pid} in {sandbox_id}") from None
        return {"pid": pid, "written": written, "closed": close}

    def kill_process(
        self,
        sandbox_id: SandboxId,
        pid: Annotated[int, Field(ge=1, le=1 << 22)],
        signal: Annotated[Literal["SIGTERM", "SIGKILL", "SIGINT", "SIGHUP"],
                          Field(description="SIGTERM asks it to stop; SIGKILL forces.")
                          ] = "SIGKILL",
    ) -> dict[str, Any]:
        """Stop a background process (and the processes it started)."""
        try:
            delivered = self.c.signal_process(sandbox_id, pid, signal)
        except ControllerError as err:
            raise _tool_error(err, f"kill_process {pid} in {sandbox_id}") from None
        return {"pid": pid, "delivered": delivered}

def _image_json(info: ImageInfo) -> dict[str, Any]:
    record = dict(info.raw)
    if "progress" in record:
        record["progress"] = record["progress"][-PROGRESS_SHOWN:]
    return record


def _ms_since(started: float) -> int:
    return int((time.monotonic() - started) * 1000)
