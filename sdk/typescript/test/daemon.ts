/**
 * Start a real `vmfork serve` for a test: a private state dir and snapshot
 * store under a fresh temp dir, a Unix socket, optionally a TCP port and a
 * token. The Python interpreter is `$VMFORK_SDK_TEST_PYTHON` (run-tests.sh sets it to the
 * project's venv), the source tree the one this SDK lives in.
 */

import { execFileSync, spawn, type ChildProcess } from "node:child_process";
import { mkdtempSync, openSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import * as net from "node:net";
import * as os from "node:os";
import * as path from "node:path";
import { fileURLToPath } from "node:url";

import { Controller } from "../src/index.js";

// build-test/test/daemon.js -> the repository root is four levels up.
export const REPO = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..", "..", "..", "..");

const DIE_WITH_PARENT = [
  "import ctypes, runpy, signal, sys",
  "PR_SET_PDEATHSIG = 1",
  "ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)",
  "sys.argv[0] = 'vmfork serve'",
  "runpy.run_module('vmfork.cli.serve', run_name='__main__', alter_sys=True)",
].join("\n");

export interface TestDaemon {
  socketUrl: string;
  tcpUrl: string | undefined;
  /** With `tls`: the CA certificate that signed the daemon's (made for this daemon). */
  caFile: string | undefined;
  token: string | undefined;
  root: string;
  stop(): Promise<void>;
}

export async function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const server = net.createServer();
    server.listen(0, "127.0.0.1", () => {
      const port = (server.address() as net.AddressInfo).port;
      server.close(() => resolve(port));
    });
    server.on("error", reject);
  });
}

/**
 * `env`: extra environment of the daemon (e.g. `VMFORK_CACHE_DIR`, an image cache of the
 * test's own). `tls`: the TCP listener serves TLS with a certificate for localhost and
 * 127.0.0.1, signed by a CA made for this daemon (tests/tls_certs.py).
 */
export async function startDaemon(
  options: { token?: string; tcp?: boolean; tls?: boolean; env?: Record<string, string> } = {},
): Promise<TestDaemon> {
  const root = mkdtempSync(path.join(os.tmpdir(), "vmfork-ts-"));
  const socket = path.join(root, "api.sock");
  // The daemon gets SIGTERM when this process dies, however it dies (a cancelled test
  // run kills its file's process without running exit handlers): PR_SET_PDEATHSIG.
  const args = ["-c", DIE_WITH_PARENT, "--state", path.join(root, "state"), "--socket", socket];
  if (options.token !== undefined) {
    writeFileSync(path.join(root, "token"), options.token);
    args.push("--token-file", path.join(root, "token"));
  }
  const python = process.env.VMFORK_SDK_TEST_PYTHON || "python3";
  const env = {
    ...process.env,
    VMFORK_HOME: path.join(root, "home"),
    PYTHONPATH: [path.join(REPO, "src"), REPO, process.env.PYTHONPATH].filter(Boolean).join(path.delimiter),
    ...options.env,
  };
  let tcpUrl: string | undefined;
  let caFile: string | undefined;
  if (options.tcp || options.tls) {
    const port = await freePort();
    args.push("--bind", `127.0.0.1:${port}`);
    tcpUrl = `${options.tls ? "https" : "http"}://127.0.0.1:${port}`;
  }
  if (options.tls) {
    const dir = path.join(root, "tls");
    execFileSync(python, ["-m", "tests.tls_certs", dir], { env, stdio: ["ignore", "ignore", "inherit"] });
    args.push("--tls-cert", path.join(dir, "server.pem"), "--tls-key", path.join(dir, "server.key"));
    caFile = path.join(dir, "ca.pem");
  }
  const logPath = path.join(root, "serve.log");
  const log = openSync(logPath, "w");
  const child: ChildProcess = spawn(python, args, { env, stdio: ["ignore", log, log] });
  const socketUrl = `unix://${socket}`;
  const probe = new Controller({ baseUrl: socketUrl, token: options.token, timeoutMs: 2000 });
  const deadline = Date.now() + 60_000;
  for (;;) {
    try {
      await probe.healthz();
      break;
    } catch {
      if (child.exitCode !== null || Date.now() > deadline) {
        child.kill("SIGKILL");
        throw new Error(`vmfork serve did not start:\n${readFileSync(logPath, "utf8")}`);
      }
      await new Promise((r) => setTimeout(r, 100));
    }
  }
  return {
    socketUrl,
    tcpUrl,
    caFile,
    token: options.token,
    root,
    async stop() {
      if (child.exitCode === null) {
        const exited = new Promise((r) => child.once("exit", r));
        child.kill("SIGTERM");
        const timer = setTimeout(() => child.kill("SIGKILL"), 30_000);
        await exited;
        clearTimeout(timer);
      }
      rmSync(root, { recursive: true, force: true });
    },
  };
}
