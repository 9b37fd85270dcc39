/**
 * `Sandbox`: the E2B-shaped handle on one sandbox, as in the Python SDK
 * (src/vmfork/client/sandbox.py).
 *
 * `Sandbox.create(tag)` spawns one through the daemon; `Sandbox.connect(id)`
 * attaches to one spawned any other way (CLI, curl, another process): the
 * daemon owns the state. `await using sb = await Sandbox.create(...)` or
 * `Sandbox.with(tag, async (sb) => ...)` kill it when the scope ends.
 * Sub-APIs are properties: `sb.commands.run`, `sb.files.read/write/list/remove`.
 */

import type { Readable } from "node:stream";

import {
  Controller,
  ControllerError,
  type BranchOptions,
  type CallOptions,
  type ListSandboxesOptions,
  type ProcessInfo,
  type StartProcessOptions,
  type WatchEvent,
  type WriteFileOptions,
} from "./controller.js";
import type { FileInfo, PingResult, SandboxInfo, SandboxMetrics, SnapshotInfo } from "./types.js";

export interface CommandResult {
  stdout: string;
  stderr: string;
  exitCode: number;
  /** The signal that killed the command, if one did. */
  signal: number | null;
  durationSecs: number;
}

/** `commands.run(..., {check: true})` and the command exited non-zero; `result` holds its output. */
export class CommandExitError extends ControllerError {
  readonly result: CommandResult;

  constructor(result: CommandResult, url: string) {
    super(200, { error: `command exited ${result.exitCode}: ${result.stderr.trim().slice(-300)}` }, url);
    this.name = "CommandExitError";
    this.result = result;
  }
}

/**
 * The command ran past its `timeoutSecs` and was killed; `stdout`/`stderr` hold
 * its output so far. Pass a larger `timeoutSecs` to `commands.run`.
 */
export class CommandTimeoutError extends ControllerError {
  readonly stdout: string;
  readonly stderr: string;

  constructor(status: number, body: unknown, url: string) {
    super(status, body, url);
    this.name = "CommandTimeoutError";
    const fields = (body ?? {}) as { stdout?: unknown; stderr?: unknown };
    this.stdout = typeof fields.stdout === "string" ? fields.stdout : "";
    this.stderr = typeof fields.stderr === "string" ? fields.stderr : "";
  }
}

export interface EvalOutcome {
  /** The repr of the value of the last expression, if any. */
  result: string | null;
  /** The exception, if the code raised one. */
  error: string | null;
  exitCode: number;
  stdout: string;
  stderr: string;
}

export interface RunOptions extends CallOptions {
  /** Seconds before the command is killed (default 60). */
  timeoutSecs?: number;
  /** Environment changes; `null` unsets a variable. */
  envs?: Record<string, string | null>;
  cwd?: string;
  stdin?: string;
  /** Called with each piece of standard output as the command writes it. */
  onStdout?: (data: string) => void;
  onStderr?: (data: string) => void;
  /** Reject with `CommandExitError` when the command exits non-zero. */
  check?: boolean;
}

export interface OutputChunk {
  stream: "stdout" | "stderr";
  data: string;
}

function argv(cmd: string | string[]): string[] {
  return typeof cmd === "string" ? ["/bin/sh", "-c", cmd] : [...cmd];
}

/**
 * A running command's output as an async iterator of `{stream, data}` chunks;
 * `wait()` resolves with the result (reading whatever was not iterated). One
 * consumer only. Leaving a `for await` loop early closes the stream, which
 * does not stop the command in the guest: it runs to its timeout.
 */
export class CommandStream implements AsyncIterable<OutputChunk> {
  private readonly events: AsyncGenerator<OutputChunk, CommandResult, undefined>;
  private settled: Promise<CommandResult> | undefined;
  private started = false;

  constructor(sandbox: Sandbox, cmd: string | string[], options: RunOptions) {
    this.events = streamCommand(sandbox, argv(cmd), options);
  }

  async *[Symbol.asyncIterator](): AsyncGenerator<OutputChunk, void, undefined> {
    if (this.started) throw new Error("CommandStream: iterate it once");
    this.started = true;
    let resolve!: (r: CommandResult) => void;
    let reject!: (e: unknown) => void;
    this.settled = new Promise<CommandResult>((res, rej) => {
      resolve = res;
      reject = rej;
    });
    this.settled.catch(() => undefined); // observed through wait(); no unhandled rejection
    try {
      for (;;) {
        const step = await this.events.next();
        if (step.done) {
          resolve(step.value);
          return;
        }
        yield step.value;
      }
    } catch (err) {
      reject(err);
      throw err;
    } finally {
      reject(new Error("CommandStream: the iteration stopped before the command ended"));
      await this.events.return(undefined as never);
    }
  }

  /** The command's result; consumes the output if nobody iterated it. */
  async wait(): Promise<CommandResult> {
    if (!this.started) {
      for await (const _ of this) {
        // Output is accumulated into the result; the chunks themselves are not needed.
      }
    }
    if (!this.settled) throw new Error("CommandStream: not started");
    return this.settled;
  }
}

async function* streamCommand(
  sandbox: Sandbox,
  args: string[],
  options: RunOptions,
): AsyncGenerator<OutputChunk, CommandResult, undefined> {
  const c = sandbox.controller;
  const out: string[] = [];
  const err: string[] = [];
  for await (const event of c.execStream(sandbox.id, args, {
    timeoutSecs: options.timeoutSecs ?? 60,
    env: options.envs,
    cwd: options.cwd,
    stdin: options.stdin,
    signal: options.signal,
    timeoutMs: options.timeoutMs,
  })) {
    if (event.event === "exit") {
      const result: CommandResult = {
        stdout: out.join(""),
        stderr: err.join(""),
        exitCode: event.exitCode,
        signal: event.signal,
        durationSecs: event.durationSecs,
      };
      if (options.check && result.exitCode !== 0) throw new CommandExitError(result, c.baseUrl);
      return result;
    }
    if (event.event === "error") {
      const status = Number(event.body.status ?? 502);
      if (event.body.timed_out) throw new CommandTimeoutError(status, event.body, c.baseUrl);
      throw new ControllerError(status, event.body, c.baseUrl);
    }
    (event.event === "stdout" ? out : err).push(event.data);
    (event.event === "stdout" ? options.onStdout : options.onStderr)?.(event.data);
    yield { stream: event.event, data: event.data };
  }
  throw new ControllerError(
    502,
    { error: "the exec stream ended without a result (the daemon or the sandbox stopped?)" },
    c.baseUrl,
  );
}

/** A background process in a sandbox: it outlives the call that started it and this handle. */
export class Process {
  constructor(
    private readonly sandbox: Sandbox,
    readonly pid: number,
    readonly pty = false,
  ) {}

  /** `{stream, data}` chunks as the process writes them (kept output from `offset` first) until it ends. */
  async *output(options: CallOptions & { offset?: number } = {}): AsyncGenerator<{ stream: string; data: Buffer }, void, undefined> {
    for await (const event of this.sandbox.controller.processOutput(this.sandbox.id, this.pid, options)) {
      if (event.event === "exit") {
        this.ended = event;
        return;
      }
      if (event.event === "error") {
        throw new ControllerError(Number(event.body.status ?? 502), event.body, this.sandbox.controller.baseUrl);
      }
      yield { stream: event.event, data: event.data };
    }
  }

  private ended: { exitCode: number; signal: number | null; durationSecs: number } | undefined;

  /** Follow it from the start until it ends; `onData` sees each chunk as it comes. */
  async wait(options: CallOptions & { onData?: (stream: string, data: Buffer) => void } = {}): Promise<CommandResult> {
    const out: Buffer[] = [];
    const err: Buffer[] = [];
    this.ended = undefined;
    for await (const { stream, data } of this.output(options)) {
      (stream === "stderr" ? err : out).push(data);
      options.onData?.(stream, data);
    }
    const end = this.ended as { exitCode: number; signal: number | null; durationSecs: number } | undefined;
    if (end === undefined) {
      throw new ControllerError(502, { error: "the output stream ended without the process's end" }, this.sandbox.controller.baseUrl);
    }
    return {
      stdout: Buffer.concat(out).toString("utf8"),
      stderr: Buffer.concat(err).toString("utf8"),
      exitCode: end.exitCode,
      signal: end.signal,
      durationSecs: end.durationSecs,
    };
  }

  sendStdin(data: string | Uint8Array, options: CallOptions = {}): Promise<number> {
    return this.sandbox.controller.sendProcessStdin(this.sandbox.id, this.pid, data, options);
  }

  async closeStdin(options: CallOptions = {}): Promise<void> {
    await this.sandbox.controller.sendProcessStdin(this.sandbox.id, this.pid, "", { ...options, eof: true });
  }

  /** Signal its process group; false if it had already exited. */
  kill(signal: string | number = "SIGKILL", options: CallOptions = {}): Promise<boolean> {
    return this.sandbox.controller.signalProcess(this.sandbox.id, this.pid, signal, options);
  }

  resize(rows: number, cols: number, options: CallOptions = {}): Promise<void> {
    return this.sandbox.controller.resizeProcessPty(this.sandbox.id, this.pid, rows, cols, options);
  }
}

export class Commands {
  constructor(private readonly sandbox: Sandbox) {}

  /**
   * Run `cmd` (a string for `/bin/sh -c`, or an argv array) and resolve with its
   * output and exit code. With `onStdout`/`onStderr` the output also streams to
   * them as it is written. A timeout rejects with `CommandTimeoutError`.
   */
  async run(cmd: string | string[], options: RunOptions = {}): Promise<CommandResult> {
    if (options.onStdout || options.onStderr) {
      return new CommandStream(this.sandbox, cmd, options).wait();
    }
    const c = this.sandbox.controller;
    let r;
    try {
      r = await c.execCommand(this.sandbox.id, argv(cmd), {
        timeoutSecs: options.timeoutSecs ?? 60,
        env: options.envs,
        cwd: options.cwd,
        stdin: options.stdin,
        signal: options.signal,
        timeoutMs: options.timeoutMs,
      });
    } catch (err) {
      if (err instanceof ControllerError && err.status === 504) {
        throw new CommandTimeoutError(err.status, err.body, err.url);
      }
      throw err;
    }
    const result: CommandResult = {
      stdout: r.stdout,
      stderr: r.stderr,
      exitCode: r.exit_code,
      signal: r.signal ?? null,
      durationSecs: r.duration_secs ?? 0,
    };
    if (options.check && result.exitCode !== 0) throw new CommandExitError(result, c.baseUrl);
    return result;
  }

  /** Start `cmd` in the background and resolve at once with its {@link Process}. */
  async start(cmd: string | string[], options: StartProcessOptions = {}): Promise<Process> {
    const r = await this.sandbox.controller.startProcess(this.sandbox.id, cmd, options);
    return new Process(this.sandbox, r.pid, r.pty);
  }

  /** The sandbox's background processes (running, and recently ended). */
  list(options: CallOptions = {}): Promise<ProcessInfo[]> {
    return this.sandbox.controller.listProcesses(this.sandbox.id, options);
  }

  /** A handle on a background process started earlier (by any client). */
  async connect(pid: number, options: CallOptions = {}): Promise<Process> {
    const info = (await this.list(options)).find((p) => p.pid === pid);
    if (info === undefined) {
      throw new ControllerError(404, { error: `sandbox ${this.sandbox.id} has no background process ${pid}` }, this.sandbox.controller.baseUrl);
    }
    return new Process(this.sandbox, pid, info.pty);
  }

  kill(pid: number, signal: string | number = "SIGKILL", options: CallOptions = {}): Promise<boolean> {
    return this.sandbox.controller.signalProcess(this.sandbox.id, pid, signal, options);
  }

  sendStdin(pid: number, data: string | Uint8Array, options: CallOptions = {}): Promise<number> {
    return this.sandbox.controller.sendProcessStdin(this.sandbox.id, pid, data, options);
  }

  /** Start `cmd` and iterate its output: `for await (const {stream, data} of sb.commands.stream(cmd))`. */
  stream(cmd: string | string[], options: RunOptions = {}): CommandStream {
    return new CommandStream(this.sandbox, cmd, options);
  }
}

export class Files {
  constructor(private readonly sandbox: Sandbox) {}

  /** The whole file, buffered; use {@link readStream} for large files. */
  read(path: string, options: CallOptions = {}): Promise<Buffer> {
    return this.sandbox.controller.readFile(this.sandbox.id, path, options);
  }

  async readText(path: string, options: CallOptions = {}): Promise<string> {
    return (await this.read(path, options)).toString("utf8");
  }

  readStream(path: string, options: CallOptions = {}): Promise<Readable> {
    return this.sandbox.controller.readFileStream(this.sandbox.id, path, options);
  }

  /** Replace the file atomically; a stream needs `length`. Resolves with the size written. */
  async write(path: string, data: string | Uint8Array | Readable, options: WriteFileOptions = {}): Promise<number> {
    return (await this.sandbox.controller.writeFile(this.sandbox.id, path, data, options)).size;
  }

  list(path: string, options: CallOptions = {}): Promise<FileInfo[]> {
    return this.sandbox.controller.listFiles(this.sandbox.id, path, options);
  }

  stat(path: string, options: CallOptions = {}): Promise<FileInfo> {
    return this.sandbox.controller.statFile(this.sandbox.id, path, options);
  }

  /** Move a guest path (an existing target is an error unless `overwrite`); resolves with its stat. */
  rename(from: string, to: string, options: CallOptions & { overwrite?: boolean } = {}): Promise<FileInfo> {
    return this.sandbox.controller.renameFile(this.sandbox.id, from, to, options);
  }

  /** Make a directory with its parents; resolves false if it was already there. */
  makeDir(path: string, options: CallOptions & { mode?: number } = {}): Promise<boolean> {
    return this.sandbox.controller.makeDir(this.sandbox.id, path, { parents: true, ...options });
  }

  exists(path: string, options: CallOptions = {}): Promise<boolean> {
    return this.sandbox.controller.fileExists(this.sandbox.id, path, options);
  }

  /** Batches of changes under a guest directory; break out of the loop to stop watching. */
  watchDir(path: string, options: CallOptions & { recursive?: boolean; onReady?: () => void } = {}): AsyncGenerator<WatchEvent[], void, undefined> {
    return this.sandbox.controller.watchDir(this.sandbox.id, path, options);
  }

  remove(path: string, options: CallOptions & { recursive?: boolean } = {}): Promise<void> {
    return this.sandbox.controller.removeFile(this.sandbox.id, path, options);
  }
}

/** Terminals: a process on a pseudo-terminal (one output stream, input by `sendInput`). */
export class Pty {
  constructor(private readonly sandbox: Sandbox) {}

  async create(options: StartProcessOptions & { rows?: number; cols?: number; cmd?: string | string[] } = {}): Promise<Process> {
    const { rows = 24, cols = 80, cmd = "/bin/sh", ...rest } = options;
    const r = await this.sandbox.controller.startProcess(this.sandbox.id, cmd, { ...rest, pty: { rows, cols } });
    return new Process(this.sandbox, r.pid, true);
  }

  sendInput(pid: number, data: string | Uint8Array, options: CallOptions = {}): Promise<number> {
    return this.sandbox.controller.sendProcessStdin(this.sandbox.id, pid, data, options);
  }

  resize(pid: number, rows: number, cols: number, options: CallOptions = {}): Promise<void> {
    return this.sandbox.controller.resizeProcessPty(this.sandbox.id, pid, rows, cols, options);
  }

  kill(pid: number, options: CallOptions = {}): Promise<boolean> {
    return this.sandbox.controller.signalProcess(this.sandbox.id, pid, "SIGKILL", options);
  }
}

export interface CreateOptions extends CallOptions {
  memoryLimitMib?: number;
  controller?: Controller;
  /** Seconds until the sandbox is killed (or paused, `onTimeout: "pause"`); default
   *  none. (`timeoutMs` is the HTTP call's.) */
  timeoutSecs?: number;
  onTimeout?: "kill" | "pause";
  /** Labels `Sandbox.list` finds it by. */
  metadata?: Record<string, string>;
  /** Environment variables every command in it gets. */
  envs?: Record<string, string>;
}

export class Sandbox implements AsyncDisposable {
  readonly id: string;
  /** As last read (create, connect, getInfo, pause, resume, setTimeout). */
  info: SandboxInfo;
  readonly controller: Controller;
  readonly commands: Commands;
  readonly files: Files;
  readonly pty: Pty;

  constructor(info: SandboxInfo, controller: Controller) {
    this.info = info;
    this.id = info.id;
    this.controller = controller;
    this.commands = new Commands(this);
    this.files = new Files(this);
    this.pty = new Pty(this);
  }

  /** Spawn one sandbox from `snapshotTag`. */
  static async create(snapshotTag: string, options: CreateOptions = {}): Promise<Sandbox> {
    const c = options.controller ?? new Controller();
    const infos = await c.spawnSandboxes({
      snapshotTag,
      n: 1,
      memoryLimitMib: options.memoryLimitMib,
      signal: options.signal,
      timeoutMs: options.timeoutMs,
      timeoutSecs: options.timeoutSecs,
      onTimeout: options.onTimeout,
      metadata: options.metadata,
      envs: options.envs,
    });
    const info = infos[0];
    if (info === undefined) throw new ControllerError(502, { error: "the daemon spawned no sandbox" }, c.baseUrl);
    return new Sandbox(info, c);
  }

  /** Attach to a sandbox by id; a paused one is resumed (same id). `timeoutSecs`
   *  extends its lifetime to at least that many seconds from now. */
  static async connect(
    sandboxId: string,
    options: { controller?: Controller; timeoutSecs?: number } & CallOptions = {},
  ): Promise<Sandbox> {
    const c = options.controller ?? new Controller();
    let info = await c.getSandbox(sandboxId, options);   // all a forkd daemon offers
    if (info.status === "paused" || options.timeoutSecs !== undefined) {
      info = await c.connectSandbox(sandboxId, options);
    }
    return new Sandbox(info, c);
  }

  /** The sandboxes whose metadata has every pair of `metadata` (and in `state`). */
  static list(options: ListSandboxesOptions & { controller?: Controller } = {}): Promise<SandboxInfo[]> {
    return (options.controller ?? new Controller()).listSandboxes(options);
  }

  /** Its info now: status, `end_at_unix`, metadata, volumes. */
  async getInfo(options: CallOptions = {}): Promise<SandboxInfo> {
    this.info = await this.controller.getSandbox(this.id, options);
    return this.info;
  }

  /** End the sandbox `timeoutSecs` from now (`null`: never). */
  async setTimeout(timeoutSecs: number | null, options: CallOptions = {}): Promise<void> {
    this.info = await this.controller.setTimeout(this.id, timeoutSecs, options);
  }

  /** Snapshot the sandbox and stop it; `resume` (or `connect`) brings it back with the
   *  same id, files and processes. */
  async pause(options: CallOptions = {}): Promise<void> {
    this.info = await this.controller.pauseSandbox(this.id, options);
  }

  async resume(options: CallOptions & { timeoutSecs?: number } = {}): Promise<void> {
    this.info = await this.controller.resumeSandbox(this.id, options);
  }

  /** CPU seconds, memory and disk use, measured now. */
  getMetrics(options: CallOptions = {}): Promise<SandboxMetrics> {
    return this.controller.sandboxMetrics(this.id, options);
  }

  /** Spawn a sandbox, run `body` with it, and kill it however `body` ends. */
  static async with<T>(
    snapshotTag: string,
    body: (sandbox: Sandbox) => Promise<T>,
    options: CreateOptions = {},
  ): Promise<T> {
    const sandbox = await Sandbox.create(snapshotTag, options);
    try {
      return await body(sandbox);
    } finally {
      await sandbox.kill();
    }
  }

  async eval(code: string, options: CallOptions & { timeoutSecs?: number } = {}): Promise<EvalOutcome> {
    const r = await this.controller.evalCode(this.id, code, options);
    return { result: r.result, error: r.error, exitCode: r.exit_code, stdout: r.stdout ?? "", stderr: r.stderr ?? "" };
  }

  ping(options: CallOptions = {}): Promise<PingResult> {
    return this.controller.pingSandbox(this.id, options);
  }

  /** Snapshot this sandbox as a new tag to spawn from; it runs on. */
  branch(options: BranchOptions = {}): Promise<SnapshotInfo> {
    return this.controller.branchSandbox(this.id, options);
  }

  /** Kill the sandbox; killing one that is already gone is not an error. */
  async kill(options: CallOptions = {}): Promise<void> {
    try {
      await this.controller.killSandbox(this.id, options);
    } catch (err) {
      if (!(err instanceof ControllerError && err.status === 404)) throw err;
    }
  }

  async [Symbol.asyncDispose](): Promise<void> {
    await this.kill();
  }

  toString(): string {
    return `Sandbox(${this.id}, snapshot=${this.info.snapshot_tag})`;
  }
}
