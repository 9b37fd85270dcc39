/**
 * The SDK with real sandboxes: needs a daemon whose KVM runs guests and a warm
 * snapshot (`answer = 41` in its interpreter). run-tests.sh e2e provides both
 * through VMFORK_URL and VMFORK_TEST_SNAPSHOT; the Controller picks the URL up
 * from the environment as a user's script would.
 */

import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { randomBytes } from "node:crypto";
import * as path from "node:path";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";
import { Readable } from "node:stream";
import { describe, test } from "node:test";

import {
  CommandExitError,
  CommandTimeoutError,
  Controller,
  ControllerError,
  Sandbox,
  type OutputChunk,
} from "../../src/index.js";

const SNAPSHOT = process.env.VMFORK_TEST_SNAPSHOT;
if (!SNAPSHOT || !process.env.VMFORK_URL) {
  throw new Error("set VMFORK_URL and VMFORK_TEST_SNAPSHOT (sdk/typescript/run-tests.sh e2e does)");
}
const TAG: string = SNAPSHOT;
const ctl = new Controller({ timeoutMs: 600_000 });

async function gone(id: string): Promise<boolean> {
  try {
    const info = await ctl.getSandbox(id);
    return info.status !== "running";
  } catch (err) {
    if (err instanceof ControllerError && err.status === 404) return true;
    throw err;
  }
}

describe("sandboxes on a real daemon", { concurrency: false }, () => {
  test("Controller: spawn two children, drive them, kill them", async () => {
    const snapshots = await ctl.listSnapshots();
    assert.ok(snapshots.some((s) => s.tag === TAG && s.status === "ready" && s.bootable));
    const infos = await ctl.spawnSandboxes({ snapshotTag: TAG, n: 2 });
    assert.equal(infos.length, 2);
    try {
      for (const info of infos) {
        assert.equal(info.snapshot_tag, TAG);
        assert.equal((await ctl.pingSandbox(info.id)).pong, true);
        const r = await ctl.execCommand(info.id, ["/bin/sh", "-c", "echo out; echo err >&2; exit 4"]);
        assert.deepEqual([r.stdout, r.stderr, r.exit_code], ["out\n", "err\n", 4]);
        assert.equal((await ctl.evalCode(info.id, "answer + 1")).result, "42");
      }
      // Separate machines from here on.
      await ctl.evalCode(infos[0]!.id, "answer = 0");
      assert.equal((await ctl.evalCode(infos[1]!.id, "answer")).result, "41");
      const listed = (await ctl.listSandboxes()).map((s) => s.id);
      for (const info of infos) assert.ok(listed.includes(info.id));
    } finally {
      for (const info of infos) await ctl.killSandbox(info.id);
    }
    for (const info of infos) assert.ok(await gone(info.id));
  });

  test("Sandbox: commands, streaming, files, eval; await using kills it", async () => {
    let id: string;
    {
      await using sb = await Sandbox.create(TAG, { controller: ctl });
      id = sb.id;
      const r = await sb.commands.run("echo hi; echo oops >&2; exit 3");
      assert.deepEqual([r.stdout, r.stderr, r.exitCode], ["hi\n", "oops\n", 3]);
      assert.equal((await sb.commands.run(["/bin/echo", "a b", "$HOME"])).stdout, "a b $HOME\n");
      assert.equal((await sb.commands.run("cat", { stdin: "piped" })).stdout, "piped");
      assert.equal((await sb.commands.run("pwd", { cwd: "/tmp" })).stdout.trim(), "/tmp");
      assert.equal((await sb.commands.run("echo $X", { envs: { X: "y" } })).stdout.trim(), "y");

      await assert.rejects(sb.commands.run("exit 5", { check: true }), (err: unknown) => {
        return err instanceof CommandExitError && err.result.exitCode === 5;
      });
      await assert.rejects(sb.commands.run("echo before; sleep 30", { timeoutSecs: 1 }), (err: unknown) => {
        return err instanceof CommandTimeoutError && err.status === 504 && err.stdout.includes("before");
      });

      // Streaming with callbacks: chunks arrive, and the result holds them all.
      const seen: string[] = [];
      const streamed = await sb.commands.run("echo a; sleep 0.3; echo b >&2; echo c", {
        onStdout: (d) => seen.push(`out:${d}`),
        onStderr: (d) => seen.push(`err:${d}`),
      });
      assert.equal(streamed.stdout, "a\nc\n");
      assert.equal(streamed.stderr, "b\n");
      assert.equal(streamed.exitCode, 0);
      assert.ok(seen.length >= 2 && seen[0] === "out:a\n", JSON.stringify(seen));

      // Streaming as an async iterator.
      const handle = sb.commands.stream("for i in 1 2 3; do echo line$i; sleep 0.1; done; exit 2");
      const chunks: OutputChunk[] = [];
      for await (const chunk of handle) chunks.push(chunk);
      assert.equal(chunks.map((c) => c.data).join(""), "line1\nline2\nline3\n");
      const done = await handle.wait();
      assert.equal(done.exitCode, 2);
      assert.equal(done.stdout, "line1\nline2\nline3\n");
      await assert.rejects(
        sb.commands.stream("echo x; sleep 30", { timeoutSecs: 1 }).wait(),
        (err: unknown) => err instanceof CommandTimeoutError && err.stdout === "x\n",
      );

      // Files: bytes, text, streams both ways, list, stat, remove.
      const payload = randomBytes(300_000);
      assert.equal(await sb.files.write("/tmp/payload.bin", payload), payload.length);
      assert.ok((await sb.files.read("/tmp/payload.bin")).equals(payload));
      const parts: Buffer[] = [];
      for await (const part of await sb.files.readStream("/tmp/payload.bin")) parts.push(part as Buffer);
      assert.ok(Buffer.concat(parts).equals(payload));
      const big = Buffer.alloc(2 * 1024 * 1024, 7);
      const pieces = [big.subarray(0, 1 << 20), big.subarray(1 << 20)];
      await sb.files.write("/tmp/sub/big.bin", Readable.from(pieces), { length: big.length, makeParents: true });
      assert.equal((await sb.files.stat("/tmp/sub/big.bin")).size, big.length);
      await sb.files.write("/tmp/sub/note.txt", "héllo\n", { mode: 0o600 });
      assert.equal(await sb.files.readText("/tmp/sub/note.txt"), "héllo\n");
      const names = (await sb.files.list("/tmp/sub")).map((e) => e.name).sort();
      assert.deepEqual(names, ["big.bin", "note.txt"]);
      assert.equal((await sb.commands.run("stat -c %a /tmp/sub/note.txt")).stdout.trim(), "600");
      await sb.files.remove("/tmp/sub", { recursive: true });
      await assert.rejects(sb.files.stat("/tmp/sub"), (err: unknown) => err instanceof ControllerError && err.status === 404);
      // A path with shell metacharacters is a name, not a command.
      await sb.files.write("/tmp/$(touch pwned);x", "safe");
      assert.equal(await sb.files.readText("/tmp/$(touch pwned);x"), "safe");
      const tmp = (await sb.files.list("/tmp")).map((e) => e.name);
      assert.ok(tmp.includes("$(touch pwned);x") && !tmp.includes("pwned"), JSON.stringify(tmp));
      assert.equal((await sb.commands.run(["test", "-e", "/pwned"])).exitCode, 1);

      const ev = await sb.eval("answer * 2");
      assert.equal(ev.result, "82");
      const failed = await sb.eval("1/0");
      assert.match(failed.error ?? "", /ZeroDivisionError/);
      assert.equal((await sb.ping()).pong, true);
    }
    assert.ok(await gone(id), "await using killed the sandbox");
  });

  test("Sandbox.with kills the sandbox when the body throws", async () => {
    let id = "";
    await assert.rejects(
      Sandbox.with(TAG, async (sb) => {
        id = sb.id;
        assert.equal((await sb.eval("answer")).result, "41");
        throw new Error("body failed");
      }, { controller: ctl }),
      /body failed/,
    );
    assert.ok(id && (await gone(id)));
    const value = await Sandbox.with(TAG, async (sb) => (await sb.commands.run("echo 7")).stdout.trim(), {
      controller: ctl,
    });
    assert.equal(value, "7");
  });

  test("aborting a command rejects at once and leaves the sandbox usable", async () => {
    await using sb = await Sandbox.create(TAG, { controller: ctl });
    const abort = new AbortController();
    const started = Date.now();
    const pending = sb.commands.run("sleep 20", { signal: abort.signal, timeoutSecs: 30 });
    setTimeout(() => abort.abort(), 300);
    await assert.rejects(pending, { name: "AbortError" });
    assert.ok(Date.now() - started < 10_000);
    assert.equal((await sb.ping()).pong, true);
  });

  test("branch: a running sandbox becomes a snapshot its children resume from", async () => {
    const branchTag = "ts-branch";
    await using source = await Sandbox.create(TAG, { controller: ctl });
    await source.eval("answer = 7");
    await source.files.write("/tmp/state.txt", "branched");
    const snap = await source.branch({ tag: branchTag, mode: "full" });
    assert.equal(snap.tag, branchTag);
    assert.equal(snap.status, "ready");
    try {
      // The source runs on, and keeps changing independently.
      await source.eval("answer = 8");
      const [child] = await ctl.spawnSandboxes({ snapshotTag: branchTag });
      try {
        assert.equal((await ctl.evalCode(child!.id, "answer")).result, "7");
        assert.equal((await ctl.readFile(child!.id, "/tmp/state.txt")).toString(), "branched");
      } finally {
        await ctl.killSandbox(child!.id);
      }
      assert.equal((await source.eval("answer")).result, "8");
      // Its chain compacted into one flat snapshot spawns the same guest.
      const flatTag = `${branchTag}-flat`;
      const flat = await ctl.compactSnapshot(branchTag, flatTag);
      try {
        assert.equal(flat.tag, flatTag);
        assert.equal(flat.branched_from, `compact:${branchTag}`);
        assert.equal((await ctl.snapshotInfo(flatTag)).chain_depth, 0);
        const [fromFlat] = await ctl.spawnSandboxes({ snapshotTag: flatTag });
        try {
          assert.equal((await ctl.evalCode(fromFlat!.id, "answer")).result, "7");
        } finally {
          await ctl.killSandbox(fromFlat!.id);
        }
      } finally {
        await ctl.deleteSnapshot(flatTag);
      }
      await assert.rejects(
        source.branch({ tag: branchTag }),
        (err: unknown) => err instanceof ControllerError && err.status === 409,
      );
    } finally {
      await ctl.deleteSnapshot(branchTag);
    }
  });

  // Bounded: a stream that never ends must fail this test, not hang the tier.
  test("background processes, a PTY and file calls in a real guest", { timeout: 300_000 }, async () => {
    await Sandbox.with(TAG, async (sb) => {
      const cat = await sb.commands.start(["cat"], { stdin: true, tag: "echo" });
      await (await sb.commands.connect(cat.pid)).sendStdin("typed later\n");
      await cat.closeStdin();
      assert.equal((await cat.wait()).stdout, "typed later\n");
      const sleeper = await sb.commands.start("sleep 60");
      assert.ok((await sb.commands.list()).some((p) => p.pid === sleeper.pid && p.running));
      assert.equal(await sleeper.kill("SIGTERM"), true);
      assert.equal((await sleeper.wait()).signal, 15);
      const term = await sb.pty.create({ rows: 30, cols: 100, cmd: ["sh", "-c", "stty size; read x; echo got:$x"] });
      await sb.pty.sendInput(term.pid, "hi\n");
      const out = (await term.wait()).stdout;
      assert.ok(out.includes("30 100") && out.includes("got:hi"), out);
      assert.equal(await sb.files.makeDir("/tmp/w/a"), true);
      await sb.files.write("/tmp/w/f", "x");
      assert.equal((await sb.files.rename("/tmp/w/f", "/tmp/w/g")).type, "file");
      assert.equal(await sb.files.exists("/tmp/w/f"), false);
      let ready!: () => void;
      const watching = new Promise<void>((resolve) => (ready = resolve));
      const seen: string[] = [];
      const watch = (async () => {
        for await (const batch of sb.files.watchDir("/tmp/w", { onReady: ready })) {
          seen.push(...batch.map((e) => `${e.type}:${e.name}`));
          // files.write is atomic (a temporary file renamed into place), so the
          // new name arrives as rename_to, as inotify reports IN_MOVED_TO.
          if (seen.includes("rename_to:new")) return;
        }
      })();
      await watching;
      await sb.files.write("/tmp/w/new", "y");
      await watch;
      assert.ok(seen.includes("rename_to:new"), seen.join(","));
    });
  });

  test("the quickstart example runs as documented", async () => {
    const example = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..", "..", "examples", "quickstart.js");
    const { stdout } = await promisify(execFile)(process.execPath, [example], {
      env: { ...process.env, VMFORK_SNAPSHOT: TAG },
      timeout: 600_000,
    });
    assert.match(stdout, /^eval: 42$/m);
    assert.match(stdout, /^stdout: streamed$/m);
    assert.match(stdout, /^stderr: also$/m);
    assert.match(stdout, /^stdout: 42$/m);
    assert.match(stdout, /^file: hello from the host$/m);
    assert.match(stdout, /^child of the branch: 7$/m);
    assert.match(stdout, /^sandboxes left: 0$/m);
  });
});
