/**
 * The vmfork TypeScript SDK: `Controller` (the daemon's REST API, forkd's method
 * names in camelCase, plus guest images) and `Sandbox` (E2B-shaped). No runtime dependencies.
 *
 *     import { Sandbox } from "vmfork";
 *     await using sb = await Sandbox.create("py-warm");
 *     console.log((await sb.commands.run("python3 -c 'print(1)'")).stdout);
 */

export {
  Controller,
  ControllerError,
  ImageBuildFailedError,
  defaultUrl,
  type BranchMode,
  type BranchOptions,
  type BuildImageOptions,
  type CallOptions,
  type ControllerOptions,
  type CreateSnapshotOptions,
  type DeleteSnapshotOptions,
  type EvalOptions,
  type ExecOptions,
  type ImageCopy,
  type ImportImageOptions,
  type ListSandboxesOptions,
  type ProcessInfo,
  type ProcessOutputEvent,
  type PullSnapshotOptions,
  type PushSnapshotOptions,
  type RemoveFileOptions,
  type SpawnOptions,
  type StartProcessOptions,
  type Volume,
  type WaitImageOptions,
  type WatchEvent,
  type WriteFileOptions,
} from "./controller.js";
export {
  CommandExitError,
  CommandStream,
  CommandTimeoutError,
  Commands,
  Files,
  Process,
  Pty,
  Sandbox,
  type CommandResult,
  type CreateOptions,
  type EvalOutcome,
  type OutputChunk,
  type RunOptions,
} from "./sandbox.js";
export { parseEndpoint, type Endpoint } from "./transport.js";
export type * from "./types.js";
