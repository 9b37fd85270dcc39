/**
 * `Controller`: one method per REST call of the vmfork daemon (`vmfork serve`),
 * with forkd's method names in camelCase, so a script written for forkd's
 * TypeScript SDK runs against vmfork by changing its import. Options are
 * camelCase here and snake_case on the wire. Results are the decoded JSON
 * records of ./types.ts. Guest images (`buildImage`, `importImage`, `listImages`,
 * `getImage`, `deleteImage`, `waitImage`) are vmfork's extension.
 *
 * Any non-2xx answer rejects with `ControllerError(status, body, url)`; a
 * daemon that cannot be reached, or does not answer within the timeout,
 * rejects with `ControllerError` status 0 and a message saying what to do.
 * Every method takes an optional `AbortSignal`; aborting rejects with the
 * signal's reason (an `AbortError` by default) and closes the connection.
 */

import { readFileSync } from "node:fs";
import type { IncomingMessage } from "node:http";
import * as os from "node:os";
import * as path from "node:path";
import { Readable } from "node:stream";

import { parseEndpoint, readAll, send, type Endpoint } from "./transport.js";
import type {
  EvalResult,
  ExecResult,
  ExecStreamEvent,
  FileInfo,
  ImageInfo,
  PingResult,
  SandboxInfo,
  SandboxMetrics,
  SnapshotDetails,
  SnapshotInfo,
  TransferJob,
  VersionInfo,
} from "./types.js";

const USER_AGENT = "vmfork-typescript";
const DEFAULT_TIMEOUT_MS = 60_000;
/** Spawning boots nothing, but a batch of many children in a busy host can take minutes. */
const MIN_SPAWN_TIMEOUT_MS = 300_000;

/**
 * `$VMFORK_URL`, `$FORKD_URL`, else the Unix socket `vmfork serve` listens on by
 * default (`$VMFORK_STATE_DIR`, `$XDG_STATE_HOME/vmfork` or
 * `~/.local/state/vmfork`, then `/api.sock`), as the Python SDK resolves it.
 */
export function defaultUrl(env: NodeJS.ProcessEnv = process.env): string {
  for (const name of ["VMFORK_URL", "FORKD_URL"]) {
    const value = env[name];
    if (value) return value;
  }
  let state = env.VMFORK_STATE_DIR;
  if (!state) {
    const base = env.XDG_STATE_HOME || path.join(os.homedir(), ".local", "state");
    state = path.join(base, "vmfork");
  }
  return "unix://" + path.resolve(state, "api.sock");
}

/**
 * The daemon answered with an error (`status` ≥ 400; `body` its decoded JSON,
 * usually `{error: "..."}`, or its text), or could not be reached (`status` 0).
 */
export class ControllerError extends Error {
  readonly status: number;
  readonly body: unknown;
  readonly url: string;

  constructor(status: number, body: unknown, url: string, options?: ErrorOptions) {
    super(`${status} from ${url}: ${reasonOf(body)}`, options);
    this.name = "ControllerError";
    this.status = status;
    this.body = body;
    this.url = url;
  }

  /** The daemon's reason: `body.error`, or the body itself when it is text. */
  get reason(): string {
    return reasonOf(this.body);
  }
}

function reasonOf(body: unknown): string {
  if (body !== null && typeof body === "object" && "error" in body) {
    return String((body as { error: unknown }).error);
  }
  return typeof body === "string" ? body : JSON.stringify(body);
}

export interface ControllerOptions {
  /** Daemon URL: `unix:///path/api.sock` or `http(s)://host:port`. Default: {@link defaultUrl}. */
  baseUrl?: string;
  /** Bearer token. Default `$VMFORK_TOKEN`, then `$FORKD_TOKEN`. */
  token?: string;
  /**
   * Milliseconds each request may take, body included (default 60 000). Exec
   * and eval add their own `timeoutSecs` on top; spawns get at least 5 minutes.
   */
  timeoutMs?: number;
  /**
   * PEM certificate(s) an `https://` daemon is verified against instead of the
   * system's roots: its CA's, or its own self-signed one. Default: the file named by
   * `caFile`, then by `$VMFORK_CA_FILE`.
   */
  ca?: string | Buffer;
  /** A file holding `ca`. */
  caFile?: string;
}

/** Per-call options every method accepts. */
export interface CallOptions {
  /** Cancels the call: the request is aborted and the promise rejects with the signal's reason. */
  signal?: AbortSignal;
  /** Overrides the controller's `timeoutMs` for this call. */
  timeoutMs?: number;
}

/**
 * A volume: `"SRC:GUEST_PATH[:ro|:rw]"` (forkd's `--volume`), or an object for a source
 * whose name holds a colon. SRC is an absolute path on the daemon's host: a directory
 * (made a read-only image) or an image file; read-write needs an image file of its own.
 */
export type Volume = string | { source: string; guest_path: string; mode?: "ro" | "rw" };

export interface SpawnOptions extends CallOptions {
  snapshotTag: string;
  /**
   * Volumes attached in each sandbox (into the snapshot's empty volume slots); a
   * read-write one needs `n: 1` and is refused (409) while another sandbox holds it.
   */
  volumes?: Volume[];
  /** How many children, 1..1000 (default 1). */
  n?: number;
  perChildNetns?: boolean;
  /** Memory limit of each child in MiB (a cgroup limit); default none. */
  memoryLimitMib?: number;
  prewarm?: boolean;
  liveFork?: boolean;
  hugepages?: boolean;
  /** The sandbox's lifetime in seconds (then killed, or paused with `onTimeout: "pause"`);
   *  default none. `timeoutMs` is this HTTP call's. */
  timeoutSecs?: number;
  onTimeout?: "kill" | "pause";
  /** Labels to list it by (at most 64; keys 1-128, values up to 1024 characters). */
  metadata?: Record<string, string>;
  /** Environment variables every command in the sandbox gets (a command's own win). */
  envs?: Record<string, string>;
}

export interface ListSandboxesOptions extends CallOptions {
  /** Only sandboxes whose metadata has every pair. */
  metadata?: Record<string, string>;
  /** Only sandboxes in these states. */
  state?: SandboxInfo["status"] | SandboxInfo["status"][];
}

export type BranchMode = "full" | "diff" | "live";

export interface BranchOptions extends CallOptions {
  /** Tag of the new snapshot; the daemon names it when unset. */
  tag?: string;
  /** `full` (default), `diff` or `live`. */
  mode?: BranchMode;
  /** Legacy forkd flag, same as `mode: "diff"`. */
  diff?: boolean;
  /** Legacy forkd flag, same as `mode: "live"`. */
  live?: boolean;
  measureDiff?: boolean;
  /** false: answer at once, the snapshot still `writing`; poll listSnapshots until `ready`. Default true. */
  wait?: boolean;
  parentTag?: string;
  /** A diff after a build: first wait (seconds) for the guest to report what it freed. */
  settleFreePages?: boolean;
}

export interface PushSnapshotOptions extends CallOptions {
  /** An Ed25519 private key (PEM) on the daemon's host. */
  signKey?: string;
  /** A Docker config file with the registry's credentials, on the daemon's host. */
  authFile?: string;
  insecure?: boolean;
  withImage?: boolean;
}

export interface PullSnapshotOptions extends CallOptions {
  /** Store the chain's head under this tag. */
  tag?: string;
  force?: boolean;
  /** An Ed25519 public key (PEM) on the daemon's host: refuse unless signed by it. */
  verifyKey?: string;
  authFile?: string;
  insecure?: boolean;
}

export interface CreateSnapshotOptions extends CallOptions {
  tag: string;
  /** Guest image name (default "default"). */
  image?: string;
  memMib?: number;
  vcpus?: number;
  /** Python run in the guest's warm interpreter before the snapshot (imports, state). */
  warmCode?: string;
  /** Shell command run in the guest before the snapshot. */
  warmCmd?: string;
  /** Read-only volumes mounted before the warm-up and in every child. */
  volumes?: Volume[];
  /** Empty volume slots reserved for volumes given at spawn (daemon default 4). */
  volumeSlots?: number;
}

export interface ExecOptions extends CallOptions {
  /** Seconds before the command is killed (default 30); a timeout rejects with status 504. */
  timeoutSecs?: number;
  /** Environment changes; a `null` value unsets the variable. */
  env?: Record<string, string | null>;
  cwd?: string;
  stdin?: string;
}

export interface StartProcessOptions extends CallOptions {
  env?: Record<string, string | null>;
  cwd?: string;
  /** Keep its stdin open for {@link Controller.sendProcessStdin}. */
  stdin?: boolean;
  /** Kill its process group after this many seconds (default: never). */
  timeoutSecs?: number;
  /** Run it on a pseudo-terminal of this size. */
  pty?: { rows: number; cols: number };
  tag?: string;
}

export interface ProcessInfo {
  pid: number;
  argv: string[];
  cwd: string | null;
  tag: string | null;
  pty: boolean;
  started_at: number;
  running: boolean;
  exit_code: number | null;
  signal: number | null;
  timed_out: boolean;
  stdin_open: boolean;
  output_bytes: number;
}

/** One event of a process's output stream. */
export type ProcessOutputEvent =
  | { event: "stdout" | "stderr" | "pty"; offset: number; data: Buffer }
  | { event: "exit"; exitCode: number; signal: number | null; timedOut: boolean; durationSecs: number; offset: number; skipped: number }
  | { event: "error"; body: Record<string, unknown> & { error: string } };

export interface WatchEvent {
  name: string;
  type: "create" | "write" | "remove" | "rename_from" | "rename_to" | "chmod";
  is_dir: boolean;
}

/** A stream that follows a live process or directory lasts as long as they do. */
const STREAM_TIMEOUT_MS = 2 ** 31 - 1;

export interface EvalOptions extends CallOptions {
  timeoutSecs?: number;
}

export interface WriteFileOptions extends CallOptions {
  /** Permission bits of the new file (default 0o644). */
  mode?: number;
  /** Create missing parent directories. */
  makeParents?: boolean;
  /** Byte count of a stream body; required when `data` is a stream (the daemon needs a Content-Length). */
  length?: number;
}

export interface RemoveFileOptions extends CallOptions {
  recursive?: boolean;
  missingOk?: boolean;
}

export interface DeleteSnapshotOptions extends CallOptions {
  /** Also delete the snapshots branched from it. */
  cascade?: boolean;
  /** Delete it even though others depend on it. */
  force?: boolean;
}

/** A file or directory copied into an image: `"SRC:DST"`, `[src, dst]` or `{src, dst}`; `src` is on the daemon's host. */
export type ImageCopy = string | [string, string] | { src: string; dst: string };

export interface BuildImageOptions extends CallOptions {
  /** The image to start from (default: the default image); `from` on the wire. */
  base?: string;
  /** Debian packages (their dependencies come along). */
  apt?: string[];
  /** Python requirements, installed as wheels. */
  pip?: string[];
  /** A requirements file's text (requirements, optionally `--hash`-pinned; no other pip options). */
  requirements?: string;
  pipIndexUrl?: string;
  /** http(s)/file URLs or absolute directories on the daemon's host. */
  pipFindLinks?: string[];
  pipNoIndex?: boolean;
  /** npm packages (run with Debian's nodejs: add it to `apt`). */
  npm?: string[];
  /** Host files in; a relative `src` is resolved against this process's directory. */
  copy?: ImageCopy[];
  /** Environment of commands run in its sandboxes. */
  env?: Record<string, string>;
  workdir?: string;
  /** NAME, UID or USER:GROUP. */
  user?: string;
  diskFormat?: "squashfs" | "squashfs-lz4" | "erofs" | "erofs-plain";
  /**
   * Shell commands run in order after the other steps, each in a build VM booted
   * from the image so far with a network; each one's changes become the next layer.
   */
  run?: string[];
  /** The run steps' egress policy: "allow" (default), "deny", or an allow-list "cidr,domain,...". */
  egress?: string;
  /** Memory of the run steps' build VM (default 1024). */
  runMemMib?: number;
  /**
   * true (default): resolve when the image is ready (a failed step rejects with
   * status 422 naming it; default timeout an hour). false: resolve at once with the
   * job (`status: "building"`); follow it with {@link Controller.waitImage}.
   */
  wait?: boolean;
}

export interface ImportImageOptions extends CallOptions {
  /** Plain HTTP to the registry. */
  insecure?: boolean;
  /** As for {@link BuildImageOptions.wait}. */
  wait?: boolean;
}

export interface WaitImageOptions {
  signal?: AbortSignal;
  /** Milliseconds to wait in all (default an hour). */
  timeoutMs?: number;
  /** Milliseconds between polls (default 1000). */
  pollMs?: number;
}

/** `waitImage`: the build or import ended `failed`; `info.error` says why, `info.progress` shows its last steps. */
export class ImageBuildFailedError extends ControllerError {
  readonly info: ImageInfo;

  constructor(info: ImageInfo, url: string) {
    super(422, { error: info.error ?? "the image build failed" }, url);
    this.name = "ImageBuildFailedError";
    this.info = info;
  }
}

function copyEntry(entry: ImageCopy): { src: string; dst: string } {
  let src: string;
  let dst: string;
  if (typeof entry === "string") {
    const colon = entry.lastIndexOf(":"); // the last ':' as the CLI: SRC may hold one
    if (colon <= 0) throw new TypeError(`copy entry ${JSON.stringify(entry)} is not SRC:DST`);
    [src, dst] = [entry.slice(0, colon), entry.slice(colon + 1)];
  } else if (Array.isArray(entry)) {
    [src, dst] = entry;
  } else {
    ({ src, dst } = entry);
  }
  // The daemon has no working directory of the caller's; a relative source means this
  // process's, which is right when the daemon runs on this host (its usual place).
  return { src: path.resolve(src), dst };
}

type Query = Record<string, string | number | boolean | undefined>;

interface RequestSpec extends CallOptions {
  query?: Query;
  json?: unknown;
  body?: Buffer | Readable;
  contentType?: string;
  length?: number;
}

export class Controller {
  readonly baseUrl: string;
  readonly token: string | undefined;
  readonly timeoutMs: number;
  private readonly endpoint: Endpoint;

  constructor(options: ControllerOptions = {}) {
    this.baseUrl = options.baseUrl ?? defaultUrl();
    const caFile = options.caFile ?? (process.env.VMFORK_CA_FILE || undefined);
    const ca = options.ca ?? (caFile !== undefined ? readFileSync(caFile) : undefined);
    this.endpoint = { ...parseEndpoint(this.baseUrl), ca };
    this.token = options.token ?? (process.env.VMFORK_TOKEN || process.env.FORKD_TOKEN || undefined);
    this.timeoutMs = options.timeoutMs ?? DEFAULT_TIMEOUT_MS;
  }

  // -- service ------------------------------------------------------------------

  healthz(options: CallOptions = {}): Promise<{ ok: boolean }> {
    return this.json("GET", "/healthz", options);
  }

  version(options: CallOptions = {}): Promise<VersionInfo> {
    return this.json("GET", "/version", options);
  }

  /** Prometheus text. */
  async metrics(options: CallOptions = {}): Promise<string> {
    return this.call("GET", "/metrics", options, async (r) => (await readAll(r)).toString("utf8"));
  }

  // -- snapshots ----------------------------------------------------------------

  listSnapshots(options: CallOptions = {}): Promise<SnapshotInfo[]> {
    return this.json("GET", "/v1/snapshots", options);
  }

  /** Boot an image, warm it, snapshot it as `tag`; resolves when it is ready (default timeout 10 minutes). */
  createSnapshot(options: CreateSnapshotOptions): Promise<SnapshotInfo> {
    const body = {
      tag: options.tag,
      image: options.image ?? "default",
      mem_mib: options.memMib ?? 256,
      vcpus: options.vcpus ?? 1,
      warm_code: options.warmCode,
      warm_cmd: options.warmCmd,
      volumes: options.volumes,
      volume_slots: options.volumeSlots,
    };
    return this.json("POST", "/v1/snapshots", {
      ...options,
      timeoutMs: options.timeoutMs ?? Math.max(this.timeoutMs, 600_000),
      json: body,
    });
  }

  snapshotInfo(tag: string, options: CallOptions = {}): Promise<SnapshotDetails> {
    return this.json("GET", `/v1/snapshots/${seg(tag)}/info`, options);
  }

  /** Publish `to`: snapshot `tag`'s whole diff chain as one flat snapshot (atomically).
   *  Resolves to the new snapshot, `branched_from: "compact:<tag>"` (as forkd). */
  compactSnapshot(tag: string, to: string, options: CallOptions = {}): Promise<SnapshotInfo> {
    return this.json("POST", `/v1/snapshots/${seg(tag)}/compact`, {
      ...options,
      timeoutMs: options.timeoutMs ?? Math.max(this.timeoutMs, 3_600_000),
      json: { to },
    });
  }

  /** Start pushing snapshot `tag`'s chain to the OCI registry `ref`
   *  (`HOST[:PORT]/REPO[:TAG]`); resolves to the job (see {@link waitTransfer}).
   *  Key and auth file paths are on the daemon's host. */
  pushSnapshot(tag: string, ref: string, options: PushSnapshotOptions = {}): Promise<TransferJob> {
    return this.json("POST", `/v1/snapshots/${seg(tag)}/push`, {
      ...options,
      json: {
        ref,
        sign_key: options.signKey ?? null,
        auth_file: options.authFile ?? null,
        insecure: options.insecure ?? false,
        with_image: options.withImage ?? true,
      },
    });
  }

  /** Start pulling the snapshot chain `ref` names into the daemon's store. */
  pullSnapshot(ref: string, options: PullSnapshotOptions = {}): Promise<TransferJob> {
    return this.json("POST", "/v1/snapshots/pull", {
      ...options,
      json: {
        ref,
        tag: options.tag ?? null,
        force: options.force ?? false,
        verify_key: options.verifyKey ?? null,
        auth_file: options.authFile ?? null,
        insecure: options.insecure ?? false,
      },
    });
  }

  getTransfer(jobId: string, options: CallOptions = {}): Promise<TransferJob> {
    return this.json("GET", `/v1/transfers/${seg(jobId)}`, options);
  }

  listTransfers(options: CallOptions = {}): Promise<TransferJob[]> {
    return this.json("GET", "/v1/transfers", options);
  }

  /** Poll a push or pull until it is done or failed (resolves with the job either way;
   *  check `status`), or reject with status 0 once `timeoutMs` passes. */
  async waitTransfer(jobId: string, options: WaitImageOptions = {}): Promise<TransferJob> {
    const timeoutMs = options.timeoutMs ?? 3_600_000;
    const pollMs = options.pollMs ?? 500;
    const deadline = Date.now() + timeoutMs;
    for (;;) {
      const job = await this.getTransfer(jobId, { signal: options.signal });
      if (job.status !== "running") return job;
      if (Date.now() + pollMs > deadline) {
        throw new ControllerError(0, `transfer ${jobId} still running after ${timeoutMs} ms`,
          this.baseUrl + `/v1/transfers/${seg(jobId)}`);
      }
      await new Promise<void>((resolve) => setTimeout(resolve, pollMs));
    }
  }

  async deleteSnapshot(tag: string, options: DeleteSnapshotOptions = {}): Promise<void> {
    await this.json("DELETE", `/v1/snapshots/${seg(tag)}`, {
      ...options,
      query: { cascade: options.cascade || undefined, force: options.force || undefined },
    });
  }

  // -- sandboxes ----------------------------------------------------------------

  spawnSandboxes(options: SpawnOptions): Promise<SandboxInfo[]> {
    const body = {
      snapshot_tag: options.snapshotTag,
      n: options.n ?? 1,
      per_child_netns: options.perChildNetns ?? false,
      memory_limit_mib: options.memoryLimitMib ?? null,
      prewarm: options.prewarm ?? false,
      live_fork: options.liveFork ?? false,
      hugepages: options.hugepages ?? false,
      volumes: options.volumes,
      // Lifecycle fields only when used: a forkd daemon knows none of them.
      timeout_secs: options.timeoutSecs,
      on_timeout: options.onTimeout,
      metadata: options.metadata,
      envs: options.envs,
    };
    return this.json("POST", "/v1/sandboxes", {
      ...options,
      timeoutMs: options.timeoutMs ?? Math.max(this.timeoutMs, MIN_SPAWN_TIMEOUT_MS),
      json: body,
    });
  }

  listSandboxes(options: ListSandboxesOptions = {}): Promise<SandboxInfo[]> {
    const state = options.state === undefined ? undefined
      : Array.isArray(options.state) ? options.state.join(",") : options.state;
    return this.json("GET", "/v1/sandboxes", {
      ...options,
      query: {
        metadata: options.metadata ? new URLSearchParams(options.metadata).toString() : undefined,
        state,
      },
    });
  }

  /** The sandbox ends `timeoutSecs` from now (`null`: never). Resolves to its info. */
  setTimeout(sandboxId: string, timeoutSecs: number | null, options: CallOptions = {}): Promise<SandboxInfo> {
    return this.json("POST", `/v1/sandboxes/${seg(sandboxId)}/timeout`, {
      ...options,
      json: { timeout_secs: timeoutSecs },
    });
  }

  /** Snapshot the sandbox and stop its VMM, keeping its id (status `paused`). */
  pauseSandbox(sandboxId: string, options: CallOptions = {}): Promise<SandboxInfo> {
    return this.json("POST", `/v1/sandboxes/${seg(sandboxId)}/pause`, {
      ...options,
      timeoutMs: options.timeoutMs ?? Math.max(this.timeoutMs, 600_000),
      json: {},
    });
  }

  /** Run a paused sandbox again in the same id; `timeoutSecs`: its new lifetime. */
  resumeSandbox(sandboxId: string, options: CallOptions & { timeoutSecs?: number } = {}): Promise<SandboxInfo> {
    return this.json("POST", `/v1/sandboxes/${seg(sandboxId)}/resume`, {
      ...options,
      timeoutMs: options.timeoutMs ?? Math.max(this.timeoutMs, MIN_SPAWN_TIMEOUT_MS),
      json: { timeout_secs: options.timeoutSecs ?? null },
    });
  }

  /** E2B's connect: resumes a paused sandbox; `timeoutSecs` only extends a running one's. */
  connectSandbox(sandboxId: string, options: CallOptions & { timeoutSecs?: number } = {}): Promise<SandboxInfo> {
    return this.json("POST", `/v1/sandboxes/${seg(sandboxId)}/connect`, {
      ...options,
      timeoutMs: options.timeoutMs ?? Math.max(this.timeoutMs, MIN_SPAWN_TIMEOUT_MS),
      json: { timeout_secs: options.timeoutSecs ?? null },
    });
  }

  /** CPU seconds, memory and disk use of a running sandbox. */
  sandboxMetrics(sandboxId: string, options: CallOptions = {}): Promise<SandboxMetrics> {
    return this.json("GET", `/v1/sandboxes/${seg(sandboxId)}/metrics`, options);
  }

  getSandbox(sandboxId: string, options: CallOptions = {}): Promise<SandboxInfo> {
    return this.json("GET", `/v1/sandboxes/${seg(sandboxId)}`, options);
  }

  async killSandbox(sandboxId: string, options: CallOptions = {}): Promise<void> {
    await this.json("DELETE", `/v1/sandboxes/${seg(sandboxId)}`, options);
  }

  pingSandbox(sandboxId: string, options: CallOptions = {}): Promise<PingResult> {
    return this.json("POST", `/v1/sandboxes/${seg(sandboxId)}/ping`, options);
  }

  /**
   * Snapshot a running sandbox as a new tag to spawn from (forkd's BRANCH). The
   * source pauses briefly and runs on. Only the fields given are sent, so the
   * daemon's defaults apply (`mode: "full"`, `wait: true`). A full copy of a large
   * guest can take long: the default timeout is an hour.
   */
  branchSandbox(sandboxId: string, options: BranchOptions = {}): Promise<SnapshotInfo> {
    const body: Record<string, unknown> = {};
    if (options.tag !== undefined) body.tag = options.tag;
    if (options.mode !== undefined) body.mode = options.mode;
    if (options.diff !== undefined) body.diff = options.diff;
    if (options.live !== undefined) body.live = options.live;
    if (options.measureDiff !== undefined) body.measure_diff = options.measureDiff;
    if (options.wait !== undefined) body.wait = options.wait;
    if (options.parentTag !== undefined) body.parent_tag = options.parentTag;
    if (options.settleFreePages !== undefined) body.settle_free_pages = options.settleFreePages;
    return this.json("POST", `/v1/sandboxes/${seg(sandboxId)}/branch`, {
      ...options,
      timeoutMs: options.timeoutMs ?? Math.max(this.timeoutMs, 3_600_000),
      json: body,
    });
  }

  /**
   * Run `args` (an argv, no shell) in the sandbox. Resolves with its output and
   * exit code whatever the code; a timeout rejects with status 504 and the
   * output so far in `body.stdout`/`body.stderr`.
   */
  execCommand(sandboxId: string, args: string[], options: ExecOptions = {}): Promise<ExecResult> {
    const timeoutSecs = options.timeoutSecs ?? 30;
    return this.json("POST", `/v1/sandboxes/${seg(sandboxId)}/exec`, {
      ...options,
      timeoutMs: options.timeoutMs ?? timeoutSecs * 1000 + this.timeoutMs,
      json: execBody(args, timeoutSecs, options),
    });
  }

  /**
   * Like {@link execCommand}, but yields the output as the command writes it:
   * `stdout`/`stderr` events, then one `exit` or `error` event. Breaking out of
   * the loop (or aborting `signal`) closes the stream.
   */
  async *execStream(
    sandboxId: string,
    args: string[],
    options: ExecOptions = {},
  ): AsyncGenerator<ExecStreamEvent, void, undefined> {
    const timeoutSecs = options.timeoutSecs ?? 30;
    const response = await this.open("POST", `/v1/sandboxes/${seg(sandboxId)}/exec/stream`, {
      ...options,
      timeoutMs: options.timeoutMs ?? timeoutSecs * 1000 + this.timeoutMs,
      json: execBody(args, timeoutSecs, options),
    });
    try {
      for await (const { event, data } of serverSentEvents(response)) {
        const payload = JSON.parse(data) as Record<string, unknown>;
        if (event === "stdout" || event === "stderr") {
          yield { event, data: String(payload.data) };
        } else if (event === "exit") {
          yield {
            event,
            exitCode: Number(payload.exit_code),
            signal: (payload.signal as number | null | undefined) ?? null,
            durationSecs: Number(payload.duration_secs ?? 0),
          };
        } else if (event === "error") {
          yield { event, body: payload as Record<string, unknown> & { error: string } };
        }
      }
    } catch (err) {
      throw this.transportError(err, `/v1/sandboxes/${seg(sandboxId)}/exec/stream`, options);
    } finally {
      response.destroy();
    }
  }

  /** Evaluate Python in the sandbox's warm interpreter (an expression's value comes back as `result`). */
  evalCode(sandboxId: string, code: string, options: EvalOptions = {}): Promise<EvalResult> {
    const body: Record<string, unknown> = { code };
    if (options.timeoutSecs !== undefined) body.timeout_secs = options.timeoutSecs;
    return this.json("POST", `/v1/sandboxes/${seg(sandboxId)}/eval`, {
      ...options,
      timeoutMs: options.timeoutMs ?? (options.timeoutSecs ?? 0) * 1000 + this.timeoutMs,
      json: body,
    });
  }

  // -- guest images (vmfork's extension) ------------------------------------------

  /**
   * Have the daemon build image `name` (as `vmfork image build`): a read-only root
   * disk of `base` plus packages, wheels, npm packages and copied files, with
   * `env`/`workdir`/`user` for exec. Only the options given are sent.
   */
  buildImage(name: string, options: BuildImageOptions = {}): Promise<ImageInfo> {
    const body: Record<string, unknown> = { name };
    if (options.base !== undefined) body.from = options.base;
    for (const [key, value] of [
      ["apt", options.apt],
      ["pip", options.pip],
      ["npm", options.npm],
      ["pip_find_links", options.pipFindLinks],
      ["run", options.run],
    ] as const) {
      if (value !== undefined && value.length) body[key] = value;
    }
    if (options.requirements !== undefined) body.requirements = options.requirements;
    if (options.pipIndexUrl !== undefined) body.pip_index_url = options.pipIndexUrl;
    if (options.pipNoIndex !== undefined) body.pip_no_index = options.pipNoIndex;
    if (options.copy !== undefined && options.copy.length) body.copy = options.copy.map(copyEntry);
    if (options.env !== undefined) body.env = options.env;
    if (options.workdir !== undefined) body.workdir = options.workdir;
    if (options.user !== undefined) body.user = options.user;
    if (options.diskFormat !== undefined) body.disk_format = options.diskFormat;
    if (options.egress !== undefined) body.egress = options.egress;
    if (options.runMemMib !== undefined) body.run_mem_mib = options.runMemMib;
    if (options.wait !== undefined) body.wait = options.wait;
    return this.json("POST", "/v1/images", {
      ...options,
      timeoutMs: options.timeoutMs ?? (options.wait === false ? undefined : Math.max(this.timeoutMs, 3_600_000)),
      json: body,
    });
  }

  /**
   * Import the OCI image `ref` (`HOST/REPO:TAG`, an OCI layout directory,
   * `oci-archive:PATH` or `docker-archive:PATH` on the daemon's host) as image `name`.
   */
  importImage(name: string, ref: string, options: ImportImageOptions = {}): Promise<ImageInfo> {
    const body: Record<string, unknown> = { name, ref };
    if (options.insecure !== undefined) body.insecure = options.insecure;
    if (options.wait !== undefined) body.wait = options.wait;
    return this.json("POST", "/v1/images/import", {
      ...options,
      timeoutMs: options.timeoutMs ?? (options.wait === false ? undefined : Math.max(this.timeoutMs, 3_600_000)),
      json: body,
    });
  }

  /** Built images and builds in flight or failed, by name. */
  listImages(options: CallOptions = {}): Promise<ImageInfo[]> {
    return this.json("GET", "/v1/images", options);
  }

  getImage(name: string, options: CallOptions = {}): Promise<ImageInfo> {
    return this.json("GET", `/v1/images/${seg(name)}`, options);
  }

  /** Remove image `name`; rejects with 409 (`body.snapshots` names them) while snapshots use it. */
  async deleteImage(name: string, options: CallOptions = {}): Promise<void> {
    await this.json("DELETE", `/v1/images/${seg(name)}`, options);
  }

  /**
   * Poll image `name` until its build is over: resolves with the ready image,
   * rejects with {@link ImageBuildFailedError} if it failed, or with status 0 when
   * `timeoutMs` passes first.
   */
  async waitImage(name: string, options: WaitImageOptions = {}): Promise<ImageInfo> {
    const timeoutMs = options.timeoutMs ?? 3_600_000;
    const pollMs = options.pollMs ?? 1000;
    const deadline = Date.now() + timeoutMs;
    for (;;) {
      const info = await this.getImage(name, { signal: options.signal });
      if (info.status === "ready") return info;
      if (info.status === "failed") throw new ImageBuildFailedError(info, this.baseUrl + `/v1/images/${seg(name)}`);
      if (Date.now() + pollMs > deadline) {
        const last = info.progress?.at(-1)?.message ?? "no progress yet";
        throw new ControllerError(
          0,
          `image ${name} still ${info.status} after ${timeoutMs} ms (last: ${last}); pass a larger timeoutMs to waitImage`,
          this.baseUrl + `/v1/images/${seg(name)}`,
        );
      }
      await new Promise<void>((resolve, reject) => {
        const onAbort = (): void => {
          clearTimeout(timer);
          reject(options.signal?.reason);
        };
        const timer = setTimeout(() => {
          options.signal?.removeEventListener("abort", onAbort);
          resolve();
        }, pollMs);
        options.signal?.addEventListener("abort", onAbort, { once: true });
      });
    }
  }

  // -- files --------------------------------------------------------------------

  /**
   * A guest file as a byte stream (for large files; {@link readFile} buffers).
   * The stream errors if it ends short of the size the daemon announced.
   */
  async readFileStream(sandboxId: string, guestPath: string, options: CallOptions = {}): Promise<Readable> {
    const response = await this.open("GET", `/v1/sandboxes/${seg(sandboxId)}/files`, {
      ...options,
      query: { path: guestPath },
    });
    const expected = response.headers["x-file-size"];
    if (expected === undefined) return response;
    const url = this.baseUrl + this.endpoint.prefix;
    let received = 0;
    async function* checked(): AsyncGenerator<Buffer> {
      for await (const chunk of response) {
        received += (chunk as Buffer).length;
        yield chunk as Buffer;
      }
      if (received !== Number(expected)) {
        throw new ControllerError(
          502,
          { error: `read ${guestPath}: got ${received} of ${expected} bytes (the stream was cut; see the daemon log)` },
          url,
        );
      }
    }
    return Readable.from(checked(), { objectMode: false });
  }

  async readFile(sandboxId: string, guestPath: string, options: CallOptions = {}): Promise<Buffer> {
    const stream = await this.readFileStream(sandboxId, guestPath, options);
    try {
      return await readAll(stream);
    } catch (err) {
      throw this.transportError(err, `/v1/sandboxes/${seg(sandboxId)}/files`, options);
    }
  }

  /**
   * Atomically replace a guest file. `data` is a string (UTF-8), bytes, or a
   * stream of bytes with its `length`.
   */
  writeFile(
    sandboxId: string,
    guestPath: string,
    data: string | Uint8Array | Readable,
    options: WriteFileOptions = {},
  ): Promise<{ path: string; size: number }> {
    let body: Buffer | Readable;
    let length: number;
    if (typeof data === "string" || data instanceof Uint8Array) {
      body = typeof data === "string" ? Buffer.from(data, "utf8") : Buffer.from(data.buffer, data.byteOffset, data.byteLength);
      length = body.length;
    } else {
      if (options.length === undefined) {
        throw new TypeError("writeFile: pass `length` (bytes) with a stream body; the daemon needs a Content-Length");
      }
      body = data;
      length = options.length;
    }
    return this.json("PUT", `/v1/sandboxes/${seg(sandboxId)}/files`, {
      ...options,
      query: { path: guestPath, mode: options.mode ?? 0o644, make_parents: options.makeParents ?? false },
      body,
      contentType: "application/octet-stream",
      length,
    });
  }

  async listFiles(sandboxId: string, guestPath: string, options: CallOptions = {}): Promise<FileInfo[]> {
    const result = await this.json<{ entries: FileInfo[] }>("GET", `/v1/sandboxes/${seg(sandboxId)}/files/list`, {
      ...options,
      query: { path: guestPath },
    });
    return result.entries;
  }

  statFile(sandboxId: string, guestPath: string, options: CallOptions = {}): Promise<FileInfo> {
    return this.json("GET", `/v1/sandboxes/${seg(sandboxId)}/files/stat`, { ...options, query: { path: guestPath } });
  }

  async removeFile(sandboxId: string, guestPath: string, options: RemoveFileOptions = {}): Promise<void> {
    await this.json("DELETE", `/v1/sandboxes/${seg(sandboxId)}/files`, {
      ...options,
      query: { path: guestPath, recursive: options.recursive ?? false, missing_ok: options.missingOk ?? false },
    });
  }

  // -- background processes and more file calls (vmfork's extension) ----------------

  /** Start a background process (a shell string or an argv) that outlives the call. */
  startProcess(sandboxId: string, cmd: string | string[], options: StartProcessOptions = {}): Promise<{ pid: number; pty: boolean; sandbox_id: string }> {
    const body: Record<string, unknown> = typeof cmd === "string" ? { cmd } : { args: cmd };
    if (options.env !== undefined) body.env = options.env;
    if (options.cwd !== undefined) body.cwd = options.cwd;
    if (options.stdin !== undefined) body.stdin = options.stdin;
    if (options.timeoutSecs !== undefined) body.timeout_secs = options.timeoutSecs;
    if (options.pty !== undefined) body.pty = { rows: options.pty.rows, cols: options.pty.cols };
    if (options.tag !== undefined) body.tag = options.tag;
    return this.json("POST", `/v1/sandboxes/${seg(sandboxId)}/processes`, { ...options, json: body });
  }

  async listProcesses(sandboxId: string, options: CallOptions = {}): Promise<ProcessInfo[]> {
    const r = await this.json<{ processes: ProcessInfo[] }>("GET", `/v1/sandboxes/${seg(sandboxId)}/processes`, options);
    return r.processes;
  }

  /**
   * A background process's output from `offset` (what the guest still keeps, then
   * live) until it ends: output events, then `exit` (or `error`). Breaking out of
   * the loop detaches; the process goes on.
   */
  async *processOutput(
    sandboxId: string,
    pid: number,
    options: CallOptions & { offset?: number } = {},
  ): AsyncGenerator<ProcessOutputEvent, void, undefined> {
    const route = `/v1/sandboxes/${seg(sandboxId)}/processes/${pid}/output`;
    const spec = { ...options, timeoutMs: options.timeoutMs ?? STREAM_TIMEOUT_MS };
    const response = await this.open("GET", route, {
      ...spec,
      query: { offset: options.offset ?? 0, encoding: "base64" },
    });
    try {
      for await (const { event, data } of serverSentEvents(response)) {
        const payload = JSON.parse(data) as Record<string, unknown>;
        if (event === "stdout" || event === "stderr" || event === "pty") {
          yield { event, offset: Number(payload.offset), data: Buffer.from(String(payload.data_b64), "base64") };
        } else if (event === "exit") {
          yield {
            event,
            exitCode: Number(payload.exit_code),
            signal: (payload.signal as number | null | undefined) ?? null,
            timedOut: Boolean(payload.timed_out),
            durationSecs: Number(payload.duration ?? 0),
            offset: Number(payload.offset),
            skipped: Number(payload.skipped ?? 0),
          };
          return;
        } else if (event === "error") {
          yield { event, body: payload as Record<string, unknown> & { error: string } };
          return;
        }
      }
    } catch (err) {
      throw this.transportError(err, route, spec);
    } finally {
      response.destroy();
    }
  }

  /** Write `data` (at most 1 MiB) to a background process's stdin; `eof` closes it after. */
  async sendProcessStdin(
    sandboxId: string,
    pid: number,
    data: string | Uint8Array,
    options: CallOptions & { eof?: boolean } = {},
  ): Promise<number> {
    const body = typeof data === "string" ? Buffer.from(data, "utf8") : Buffer.from(data.buffer, data.byteOffset, data.byteLength);
    const r = await this.json<{ written: number }>("POST", `/v1/sandboxes/${seg(sandboxId)}/processes/${pid}/stdin`, {
      ...options,
      query: { eof: options.eof ?? false },
      body,
      contentType: "application/octet-stream",
    });
    return r.written;
  }

  /** Signal a background process (its group unless `group: false`); false if it had exited. */
  async signalProcess(
    sandboxId: string,
    pid: number,
    signal: string | number = "SIGKILL",
    options: CallOptions & { group?: boolean } = {},
  ): Promise<boolean> {
    const r = await this.json<{ delivered: boolean }>("POST", `/v1/sandboxes/${seg(sandboxId)}/processes/${pid}/signal`, {
      ...options,
      json: { signal, group: options.group ?? true },
    });
    return r.delivered;
  }

  async resizeProcessPty(sandboxId: string, pid: number, rows: number, cols: number, options: CallOptions = {}): Promise<void> {
    await this.json("POST", `/v1/sandboxes/${seg(sandboxId)}/processes/${pid}/resize`, { ...options, json: { rows, cols } });
  }

  renameFile(sandboxId: string, from: string, to: string, options: CallOptions & { overwrite?: boolean } = {}): Promise<FileInfo> {
    return this.json("POST", `/v1/sandboxes/${seg(sandboxId)}/files/rename`, {
      ...options,
      json: { path: from, new_path: to, overwrite: options.overwrite ?? false },
    });
  }

  /** Make a directory; resolves false when `parents` found it already there. */
  async makeDir(sandboxId: string, guestPath: string, options: CallOptions & { parents?: boolean; mode?: number } = {}): Promise<boolean> {
    const r = await this.json<{ created: boolean }>("POST", `/v1/sandboxes/${seg(sandboxId)}/files/mkdir`, {
      ...options,
      json: { path: guestPath, parents: options.parents ?? false, mode: options.mode ?? 0o755 },
    });
    return r.created;
  }

  async fileExists(sandboxId: string, guestPath: string, options: CallOptions = {}): Promise<boolean> {
    const r = await this.json<{ exists: boolean }>("GET", `/v1/sandboxes/${seg(sandboxId)}/files/exists`, {
      ...options,
      query: { path: guestPath },
    });
    return r.exists;
  }

  /** Batches of changes under a guest directory, as they happen; break out of the loop to stop. */
  async *watchDir(
    sandboxId: string,
    guestPath: string,
    options: CallOptions & { recursive?: boolean; onReady?: () => void } = {},
  ): AsyncGenerator<WatchEvent[], void, undefined> {
    const route = `/v1/sandboxes/${seg(sandboxId)}/files/watch`;
    const spec = { ...options, timeoutMs: options.timeoutMs ?? STREAM_TIMEOUT_MS };
    const response = await this.open("GET", route, {
      ...spec,
      query: { path: guestPath, recursive: options.recursive ?? false },
    });
    try {
      for await (const { event, data } of serverSentEvents(response)) {
        const payload = JSON.parse(data) as Record<string, unknown>;
        if (event === "watching") options.onReady?.();
        else if (event === "events") yield payload.events as WatchEvent[];
        else if (event === "end") return;
        else if (event === "error") throw new ControllerError(Number(payload.status ?? 502), payload, this.baseUrl + route);
      }
    } catch (err) {
      throw this.transportError(err, route, spec);
    } finally {
      response.destroy();
    }
  }

  // -- plumbing -----------------------------------------------------------------

  private async json<T>(method: string, route: string, spec: RequestSpec): Promise<T> {
    return this.call(method, route, spec, async (response) => {
      const raw = await readAll(response);
      return (raw.length ? JSON.parse(raw.toString("utf8")) : null) as T;
    });
  }

  /** `open`, then `consume` the body under the same deadline and signal. */
  private async call<T>(
    method: string,
    route: string,
    spec: RequestSpec,
    consume: (response: IncomingMessage) => Promise<T>,
  ): Promise<T> {
    const response = await this.open(method, route, spec);
    try {
      return await consume(response);
    } catch (err) {
      throw this.transportError(err, route, spec);
    } finally {
      response.destroy();
    }
  }

  /** Send a request; resolve with a 2xx response whose body is still unread. */
  private async open(method: string, route: string, spec: RequestSpec): Promise<IncomingMessage> {
    const pathAndQuery = route + encodeQuery(spec.query);
    const headers: Record<string, string> = { "User-Agent": USER_AGENT, Accept: "application/json" };
    if (this.token) headers.Authorization = `Bearer ${this.token}`;
    let body = spec.body;
    if (spec.json !== undefined) {
      body = Buffer.from(JSON.stringify(spec.json), "utf8");
      headers["Content-Type"] = "application/json";
    } else if (spec.contentType) {
      headers["Content-Type"] = spec.contentType;
    }
    if (spec.length !== undefined) headers["Content-Length"] = String(spec.length);
    else if (Buffer.isBuffer(body)) headers["Content-Length"] = String(body.length);
    else if (method === "POST" || method === "PUT") headers["Content-Length"] = "0";

    const signal = this.deadline(spec);
    let response: IncomingMessage;
    try {
      response = await send(this.endpoint, { method, path: pathAndQuery, headers, body, signal });
    } catch (err) {
      throw this.transportError(err, route, spec);
    }
    const status = response.statusCode ?? 0;
    if (status >= 400) {
      let raw: Buffer;
      try {
        raw = await readAll(response);
      } catch (err) {
        throw this.transportError(err, route, spec);
      } finally {
        response.destroy();
      }
      const text = raw.toString("utf8");
      let decoded: unknown = text;
      try {
        decoded = JSON.parse(text);
      } catch {
        // Not JSON (a proxy's error page): keep the text.
      }
      throw new ControllerError(status, decoded, this.baseUrl + pathAndQuery);
    }
    return response;
  }

  /** The caller's signal combined with this call's timeout. */
  private deadline(spec: CallOptions): AbortSignal {
    const timeout = AbortSignal.timeout(spec.timeoutMs ?? this.timeoutMs);
    return spec.signal ? AbortSignal.any([spec.signal, timeout]) : timeout;
  }

  /**
   * The caller's abort passes through unchanged; our own timeout and failures
   * to connect become `ControllerError` status 0 naming the knob to turn.
   */
  private transportError(err: unknown, route: string, spec: CallOptions): unknown {
    if (err instanceof ControllerError) return err;
    if (spec.signal?.aborted) return spec.signal.reason ?? err;
    const url = this.baseUrl + route;
    const name = (err as { name?: string } | null)?.name;
    if (name === "TimeoutError" || name === "AbortError") {
      const ms = spec.timeoutMs ?? this.timeoutMs;
      return new ControllerError(0, `no complete answer within ${ms} ms (pass a larger timeoutMs)`, url, { cause: err });
    }
    const message = err instanceof Error ? err.message : String(err);
    const code = String((err as { code?: unknown } | null)?.code ?? "");
    if (TLS_TRUST_ERRORS.has(code)) {
      return new ControllerError(
        0,
        `the vmfork daemon at ${this.baseUrl} has a certificate this client does not trust: ${message} (give its CA certificate with the ca/caFile option or VMFORK_CA_FILE)`,
        url,
        { cause: err },
      );
    }
    return new ControllerError(
      0,
      `cannot reach the vmfork daemon at ${this.baseUrl}: ${message} (start it with \`vmfork serve\`, or set VMFORK_URL)`,
      url,
      { cause: err },
    );
  }
}

/** node:tls's codes for a certificate the client cannot verify (OpenSSL's names). */
const TLS_TRUST_ERRORS = new Set([
  "UNABLE_TO_VERIFY_LEAF_SIGNATURE",
  "UNABLE_TO_GET_ISSUER_CERT_LOCALLY",
  "SELF_SIGNED_CERT_IN_CHAIN",
  "DEPTH_ZERO_SELF_SIGNED_CERT",
  "CERT_HAS_EXPIRED",
  "CERT_NOT_YET_VALID",
  "ERR_TLS_CERT_ALTNAME_INVALID",
]);

/** One path segment, percent-encoded (the daemon validates it). */
function seg(value: string): string {
  return encodeURIComponent(value);
}

function encodeQuery(query: Query | undefined): string {
  if (!query) return "";
  const params = new URLSearchParams();
  for (const [key, value] of Object.entries(query)) {
    if (value !== undefined) params.append(key, String(value));
  }
  const text = params.toString();
  return text ? "?" + text : "";
}

function execBody(args: string[], timeoutSecs: number, options: ExecOptions): Record<string, unknown> {
  const body: Record<string, unknown> = { args, timeout_secs: timeoutSecs };
  if (options.env !== undefined) body.env = options.env;
  if (options.cwd !== undefined) body.cwd = options.cwd;
  if (options.stdin !== undefined) body.stdin = options.stdin;
  return body;
}

/** Parse a text/event-stream body into `{event, data}` records. */
async function* serverSentEvents(stream: AsyncIterable<Buffer | string>): AsyncGenerator<{ event: string; data: string }> {
  let buffered = "";
  let event = "message";
  let data: string[] = [];
  const decoder = new TextDecoder("utf-8");
  for await (const chunk of stream) {
    buffered += typeof chunk === "string" ? chunk : decoder.decode(chunk, { stream: true });
    let newline: number;
    while ((newline = buffered.indexOf("\n")) >= 0) {
      const line = buffered.slice(0, newline).replace(/\r$/, "");
      buffered = buffered.slice(newline + 1);
      if (line === "") {
        if (data.length) yield { event, data: data.join("\n") };
        event = "message";
        data = [];
      } else if (line.startsWith("event:")) {
        event = line.slice(6).trim();
      } else if (line.startsWith("data:")) {
        data.push(line.slice(5).trimStart());
      }
    }
  }
}
