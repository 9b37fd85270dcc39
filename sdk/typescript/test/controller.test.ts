/**
 * The Controller against a real `vmfork serve` on routes that spawn nothing
 * (they run anywhere, no KVM needed): URLs and environment, auth, request
 * shaping (snake_case fields and queries, checked by the daemon's strict
 * validation), errors, timeouts and cancellation.
 */

import assert from "node:assert/strict";
import * as net from "node:net";
import { Readable } from "node:stream";
import { after, before, describe, test } from "node:test";

import { Controller, ControllerError, Sandbox, defaultUrl, parseEndpoint } from "../src/index.js";
import { startDaemon, type TestDaemon } from "./daemon.js";

const TOKEN = "test-token-0123456789abcdef";

async function rejectsWith(promise: Promise<unknown>, status: number, reason: RegExp): Promise<ControllerError> {
  try {
    await promise;
  } catch (err) {
    assert.ok(err instanceof ControllerError, `expected a ControllerError, got ${String(err)}`);
    assert.equal(err.status, status, err.message);
    assert.match(err.reason, reason);
    return err;
  }
  assert.fail(`expected a ${status} ControllerError`);
}

describe("URLs and environment", () => {
  test("unix and http URLs parse as the Python SDK's do", () => {
    assert.deepEqual(parseEndpoint("unix:///run/vmfork/api.sock"), {
      url: "unix:///run/vmfork/api.sock",
      socketPath: "/run/vmfork/api.sock",
      protocol: "http:",
      hostname: "localhost",
      prefix: "",
    });
    const tcp = parseEndpoint("https://[::1]:8443/vmfork/");
    assert.equal(tcp.hostname, "::1");
    assert.equal(tcp.port, 8443);
    assert.equal(tcp.prefix, "/vmfork");
    assert.throws(() => parseEndpoint("unix://relative/api.sock"), /unix:\/\/\/absolute/);
    assert.throws(() => parseEndpoint("ftp://host"), /not a daemon URL/);
    assert.throws(() => new Controller({ baseUrl: "localhost:8889" }), /not a daemon URL/);
  });

  test("VMFORK_URL wins over FORKD_URL; without either, the state dir's socket", () => {
    assert.equal(defaultUrl({ VMFORK_URL: "http://a:1", FORKD_URL: "http://b:2" }), "http://a:1");
    assert.equal(defaultUrl({ FORKD_URL: "http://b:2" }), "http://b:2");
    assert.equal(defaultUrl({ VMFORK_STATE_DIR: "/srv/vm" }), "unix:///srv/vm/api.sock");
    assert.equal(defaultUrl({ XDG_STATE_HOME: "/xdg" }), "unix:///xdg/vmfork/api.sock");
  });

  test("the token comes from VMFORK_TOKEN, then FORKD_TOKEN", () => {
    const saved = { v: process.env.VMFORK_TOKEN, f: process.env.FORKD_TOKEN };
    try {
      delete process.env.VMFORK_TOKEN;
      process.env.FORKD_TOKEN = "forkd-token";
      assert.equal(new Controller({ baseUrl: "http://h:1" }).token, "forkd-token");
      process.env.VMFORK_TOKEN = "vmfork-token";
      assert.equal(new Controller({ baseUrl: "http://h:1" }).token, "vmfork-token");
      assert.equal(new Controller({ baseUrl: "http://h:1", token: "explicit" }).token, "explicit");
    } finally {
      for (const [name, value] of [["VMFORK_TOKEN", saved.v], ["FORKD_TOKEN", saved.f]] as const) {
        if (value === undefined) delete process.env[name];
        else process.env[name] = value;
      }
    }
  });
});

describe("against vmfork serve (no sandboxes)", () => {
  let daemon: TestDaemon;
  let ctl: Controller;

  before(async () => {
    daemon = await startDaemon({ token: TOKEN, tcp: true });
    ctl = new Controller({ baseUrl: daemon.socketUrl, token: TOKEN });
  });
  after(async () => {
    await daemon?.stop();
  });

  test("service routes over the Unix socket and over TCP", async () => {
    assert.deepEqual(await ctl.healthz(), { ok: true });
    assert.equal((await ctl.version()).api, "v1");
    assert.deepEqual(await ctl.listSnapshots(), []);
    assert.deepEqual(await ctl.listSandboxes(), []);
    assert.match(await ctl.metrics(), /^vmfork_sandboxes_active 0(\.0)?$/m);
    const tcp = new Controller({ baseUrl: daemon.tcpUrl!, token: TOKEN });
    assert.deepEqual(await tcp.listSnapshots(), []);
  });

  test("auth: no token and a wrong token are 401 with the daemon's reason", async () => {
    const anonymous = new Controller({ baseUrl: daemon.socketUrl, token: "" });
    assert.deepEqual(await anonymous.healthz(), { ok: true });
    const err = await rejectsWith(anonymous.listSnapshots(), 401, /^missing bearer token$/);
    assert.deepEqual(err.body, { error: "missing bearer token" });
    assert.match(err.url, /\/v1\/snapshots$/);
    const wrong = new Controller({ baseUrl: daemon.tcpUrl!, token: "not-the-token-at-all" });
    await rejectsWith(wrong.listSandboxes(), 401, /^invalid bearer token$/);
  });

  test("spawn options go out snake_case (the daemon rejects unknown fields)", async () => {
    await rejectsWith(ctl.spawnSandboxes({ snapshotTag: "absent" }), 404, /no snapshot tagged 'absent'/);
    await rejectsWith(ctl.spawnSandboxes({ snapshotTag: "absent", n: 0 }), 400, /\bn\b/);
    await rejectsWith(ctl.spawnSandboxes({ snapshotTag: "absent", memoryLimitMib: 1 }), 400, /memory_limit_mib/);
    // Accepted as per_child_netns (a camelCase field would be 400, unknown): the
    // snapshot lookup is what fails.
    await rejectsWith(ctl.spawnSandboxes({ snapshotTag: "absent", perChildNetns: true }), 404, /no snapshot tagged 'absent'/);
    await rejectsWith(ctl.spawnSandboxes({ snapshotTag: "absent", liveFork: true }), 400, /live_fork/);
    await rejectsWith(ctl.spawnSandboxes({ snapshotTag: "../etc" }), 400, /snapshot_tag/);
  });

  test("unknown sandboxes and snapshots are 404 on every route", async () => {
    const id = "sb-does-not-exist";
    await rejectsWith(ctl.getSandbox(id), 404, new RegExp(id));
    await rejectsWith(ctl.pingSandbox(id), 404, new RegExp(id));
    await rejectsWith(ctl.killSandbox(id), 404, new RegExp(id));
    await rejectsWith(ctl.execCommand(id, ["true"]), 404, new RegExp(id));
    await rejectsWith(ctl.evalCode(id, "1"), 404, new RegExp(id));
    await rejectsWith(ctl.listFiles(id, "/tmp"), 404, new RegExp(id));
    await rejectsWith(ctl.readFile(id, "/etc/hostname"), 404, new RegExp(id));
    await rejectsWith(ctl.writeFile(id, "/tmp/x", "data"), 404, new RegExp(id));
    await rejectsWith(ctl.removeFile(id, "/tmp/x"), 404, new RegExp(id));
    await rejectsWith(Sandbox.connect(id, { controller: ctl }), 404, new RegExp(id));
    await rejectsWith(ctl.deleteSnapshot("absent"), 404, /absent/);
    await rejectsWith(ctl.snapshotInfo("absent"), 404, /absent/);
    await rejectsWith(ctl.compactSnapshot("absent", "flat"), 404, /absent/);
    await rejectsWith(ctl.compactSnapshot("absent", "no/slash"), 400, /to/);
    // A tag that would escape the store is refused, whatever the encoding.
    await rejectsWith(ctl.snapshotInfo("../../etc"), 400, /tag/);
  });

  test("lifecycle options and calls reach the daemon's validation as snake_case", async () => {
    // Accepted fields: the snapshot lookup is what fails.
    await rejectsWith(ctl.spawnSandboxes({
      snapshotTag: "absent", timeoutSecs: 60, onTimeout: "pause", metadata: { team: "red" }, envs: { A: "1" },
    }), 404, /no snapshot tagged 'absent'/);
    await rejectsWith(ctl.spawnSandboxes({ snapshotTag: "absent", timeoutSecs: 0 }), 400, /timeout_secs/);
    await rejectsWith(ctl.spawnSandboxes({ snapshotTag: "absent", metadata: { "": "v" } }), 400, /metadata/);
    await rejectsWith(ctl.spawnSandboxes({ snapshotTag: "absent", envs: { "1X": "v" } }), 400, /invalid variable name '1X'/);
    assert.deepEqual(await ctl.listSandboxes({ metadata: { team: "red", "a&b": "c=d" }, state: ["running", "paused"] }), []);
    assert.deepEqual(await Sandbox.list({ controller: ctl, metadata: { team: "red" } }), []);
    await rejectsWith(ctl.listSandboxes({ state: "sleeping" as "running" }), 400, /state must be/);
    const id = "sb-does-not-exist";
    await rejectsWith(ctl.setTimeout(id, 30), 404, new RegExp(id));
    await rejectsWith(ctl.setTimeout(id, 0), 400, /timeout_secs/);
    await rejectsWith(ctl.pauseSandbox(id), 404, new RegExp(id));
    await rejectsWith(ctl.resumeSandbox(id, { timeoutSecs: 30 }), 404, new RegExp(id));
    await rejectsWith(ctl.connectSandbox(id), 404, new RegExp(id));
    await rejectsWith(ctl.sandboxMetrics(id), 404, new RegExp(id));
  });

  test("exec arguments are checked before the sandbox is looked up", async () => {
    await rejectsWith(ctl.execCommand("sb-x", []), 400, /args/);
    await rejectsWith(ctl.execCommand("sb-x", ["true"], { timeoutSecs: 0 }), 400, /timeout_secs/);
  });

  test("a killed sandbox is not an error for Sandbox.kill", async () => {
    const gone = new Sandbox({ id: "sb-gone", snapshot_tag: "t", created_at_unix: 0, pid: 0, branch_count: 0, status: "exited" }, ctl);
    await gone.kill();
    await assert.rejects(gone.ping(), (err: unknown) => err instanceof ControllerError && err.status === 404);
  });

  test("a stream upload needs its length", () => {
    assert.throws(() => ctl.writeFile("sb-x", "/tmp/x", Readable.from([Buffer.from("x")])), /length/);
  });

  test("an already-aborted signal rejects before anything is sent", async () => {
    const reason = new Error("caller gave up");
    await assert.rejects(ctl.listSnapshots({ signal: AbortSignal.abort(reason) }), (err) => err === reason);
  });
});

describe("transport failures", () => {
  test("a missing socket is status 0 saying how to start the daemon", async () => {
    const ctl = new Controller({ baseUrl: "unix:///nonexistent/vmfork/api.sock" });
    await rejectsWith(ctl.listSnapshots(), 0, /cannot reach the vmfork daemon .*vmfork serve/);
  });

  describe("a peer that accepts and never answers", () => {
    let silent: net.Server;
    let url: string;
    const sockets = new Set<net.Socket>();
    before(async () => {
      silent = net.createServer((s) => {
        sockets.add(s);
        s.resume(); // read (and drop) the request, so the client's close is seen
        s.on("close", () => sockets.delete(s));
      });
      await new Promise<void>((r) => silent.listen(0, "127.0.0.1", r));
      url = `http://127.0.0.1:${(silent.address() as net.AddressInfo).port}`;
    });
    after(async () => {
      for (const s of sockets) s.destroy();
      await new Promise((r) => silent.close(r));
    });

    test("times out with status 0 naming timeoutMs, and closes the connection", async () => {
      const ctl = new Controller({ baseUrl: url, timeoutMs: 300 });
      const started = Date.now();
      await rejectsWith(ctl.listSnapshots(), 0, /within 300 ms .*timeoutMs/);
      assert.ok(Date.now() - started < 5000);
      await new Promise((r) => setTimeout(r, 100));
      assert.equal(sockets.size, 0);
    });

    test("aborting in flight rejects with the signal's reason and closes the connection", async () => {
      const ctl = new Controller({ baseUrl: url });
      const abort = new AbortController();
      const pending = ctl.spawnSandboxes({ snapshotTag: "t", signal: abort.signal });
      await new Promise((r) => setTimeout(r, 100));
      assert.equal(sockets.size, 1);
      abort.abort();
      await assert.rejects(pending, { name: "AbortError" });
      await new Promise((r) => setTimeout(r, 100));
      assert.equal(sockets.size, 0);
    });
  });
});
