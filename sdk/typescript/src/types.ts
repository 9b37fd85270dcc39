/**
 * The daemon's records, as they travel on the wire (snake_case), from
 * src/vmfork/server/openapi.json. Fields forkd has and vmfork does not fill are
 * optional; unknown fields are kept (the daemon may add some).
 */

export type SnapshotStatus = "writing" | "ready" | "failed";

export interface SnapshotInfo {
  tag: string;
  dir: string;
  created_at_unix: number;
  status: SnapshotStatus;
  bootable: boolean;
  branched_from?: string;
  pause_ms?: number;
  diff_ms?: number;
  diff_physical_bytes?: number;
  diff_logical_bytes?: number;
  warning?: string;
  error?: string;
  image?: string;
  mem_mib?: number;
  vcpus?: number;
  warm_up?: string | null;
  [extra: string]: unknown;
}

export interface SnapshotDetails {
  tag: string;
  dir: string;
  created_at_unix: number;
  memory_logical_bytes: number;
  memory_physical_bytes: number;
  vmstate_bytes: number;
  parent_tag?: string | null;
  parent_content_hash?: string | null;
  chain_depth: number;
  dependents: string[];
  ancestors: string[];
  status?: SnapshotStatus;
  bootable?: boolean;
  [extra: string]: unknown;
}

export interface SandboxInfo {
  id: string;
  snapshot_tag: string;
  created_at_unix: number;
  pid: number;
  branch_count: number;
  status: "running" | "paused" | "exited" | "lost";
  /** vmfork's lifecycle: the lifetime last set, and when the reaper ends it (unix s). */
  timeout_secs?: number | null;
  end_at_unix?: number | null;
  on_timeout?: "kill" | "pause";
  metadata?: Record<string, string>;
  /** The names of its sandbox-wide envs (values are not shown). */
  env_names?: string[];
  volumes?: { source: string; guest_path: string; mode: "ro" | "rw"; from_snapshot: boolean }[];
  /** While paused: the snapshot it resumes from. */
  paused_snapshot?: string | null;
  paused_at_unix?: number | null;
  netns?: string | null;
  guest_addr?: string | null;
  memory_limit_mib?: number | null;
  has_branched?: boolean;
  last_branch_memory_path?: string | null;
  exit_reason?: string | null;
  exit_description?: string | null;
  [extra: string]: unknown;
}

/** What a sandbox uses, measured by the daemon (`GET /v1/sandboxes/{id}/metrics`). */
export interface SandboxMetrics {
  sandbox_id: string;
  timestamp_unix: number;
  cpu_seconds: number | null;
  memory_rss_bytes: number | null;
  memory_private_dirty_bytes: number | null;
  memory_cgroup_bytes: number | null;
  guest_mem_mib: number | null;
  disk_total_bytes: number | null;
  disk_used_bytes: number | null;
  disk_inodes_used?: number | null;
  [extra: string]: unknown;
}

export interface PingResult {
  pong: boolean;
  pid?: number;
  version?: string;
  protocol?: number;
  uptime?: number;
  boot_id?: string | null;
  [extra: string]: unknown;
}

export interface ExecResult {
  stdout: string;
  stderr: string;
  exit_code: number;
  signal?: number | null;
  duration_secs?: number;
}

export interface EvalResult {
  result: string | null;
  error: string | null;
  exit_code: number;
  stdout?: string;
  stderr?: string;
  traceback?: string | null;
  value_truncated?: boolean;
}

export interface FileInfo {
  name: string;
  path?: string | null;
  type: string;
  size: number;
  mode: number;
  mtime: number;
  target?: string | null;
}

export interface VersionInfo {
  version: string;
  api: string;
  implementation?: string;
}

/** One server-sent event of `POST /v1/sandboxes/{id}/exec/stream`. */
export type ExecStreamEvent =
  | { event: "stdout" | "stderr"; data: string }
  | { event: "exit"; exitCode: number; signal: number | null; durationSecs: number }
  | { event: "error"; body: Record<string, unknown> & { error: string; status?: number } };

export type ImageStatus = "building" | "ready" | "failed";

/** One line a build reported: its step (`base`, `apt`, `pip`, `copy`, `disk`, ...), what it did, when (unix seconds). */
export interface ImageProgress {
  step: string;
  message: string;
  at: number;
}

/**
 * A guest image (`status: "ready"`), or its build or import (`"building"`, or
 * `"failed"` with `error`), from `/v1/images`. Sizes in bytes; paths are on the
 * daemon's host. `previous` is the image that keeps the name while it is rebuilt,
 * or after a rebuild failed.
 */
export interface ImageInfo {
  name: string;
  status: ImageStatus;
  size?: number;
  root?: "initramfs" | "disk";
  disk?: string | null;
  disk_format?: string | null;
  disk_size?: number;
  kernel_size?: number;
  initrd_size?: number;
  built_from?: string;
  definition?: Record<string, unknown>;
  /** ISO 8601, UTC. */
  created?: string;
  env?: string[];
  workdir?: string | null;
  user?: string | null;
  agent_python?: string | null;
  files_present?: boolean;
  kind?: "build" | "import";
  from?: string;
  started_at_unix?: number;
  finished_at_unix?: number;
  /** The build's last lines (at most 200); `progress_lines` counts them all. */
  progress?: ImageProgress[];
  progress_lines?: number;
  error?: string;
  previous?: ImageInfo;
  [extra: string]: unknown;
}

/** A push or pull of a snapshot chain through an OCI registry (docs/distribution.md). */
export type TransferStatus = "running" | "done" | "failed";

export interface TransferJob {
  id: string;
  kind: "push" | "pull";
  ref: string;
  tag?: string | null;
  status: TransferStatus;
  started_at_unix?: number;
  finished_at_unix?: number;
  progress: { what: string; bytes_done: number; bytes_total: number };
  /** The push report (digest, uploaded, mounted, present, ...) or the pull report
   *  (digest, stored, present, downloaded, skipped, resumed, ...), once done. */
  result?: Record<string, unknown>;
  error?: string;
  [extra: string]: unknown;
}
