/**
 * Sandbox lifecycle with real sandboxes (issue 15): envs, metadata and the list filter,
 * metrics, pause and resume into the same id with a file and a running process kept,
 * a timeout that kills. Run by run-tests.sh e2e (VMFORK_URL, VMFORK_TEST_SNAPSHOT).
 */

import assert from "node:assert/strict";
import { describe, test } from "node:test";

import { Controller, Sandbox } from "../../src/index.js";

const SNAPSHOT = process.env.VMFORK_TEST_SNAPSHOT;
if (!SNAPSHOT || !process.env.VMFORK_URL) {
  throw new Error("set VMFORK_URL and VMFORK_TEST_SNAPSHOT (sdk/typescript/run-tests.sh e2e does)");
}
const TAG: string = SNAPSHOT;
const ctl = new Controller({ timeoutMs: 600_000 });

function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

describe("lifecycle", { timeout: 600_000 }, () => {
  test("envs, metadata, metrics, pause and resume into the same id", async () => {
    const label = `ts-${process.pid}`;
    await using sb = await Sandbox.create(TAG, { controller: ctl, envs: { LIFE: "ts" }, metadata: { suite: label } });
    assert.equal((await sb.commands.run("echo $LIFE")).stdout, "ts\n");
    assert.deepEqual((await Sandbox.list({ controller: ctl, metadata: { suite: label } })).map((s) => s.id), [sb.id]);
    const metrics = await sb.getMetrics();
    assert.ok((metrics.cpu_seconds ?? 0) > 0 && (metrics.memory_rss_bytes ?? 0) > 1 << 20, JSON.stringify(metrics));
    assert.ok((metrics.disk_total_bytes ?? 0) > 0, JSON.stringify(metrics));

    await sb.files.write("/tmp/kept", "from typescript");
    const counter = await sb.commands.start("i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 0.2; done");
    await sleep(1000);
    const oldPid = sb.info.pid;
    await sb.pause();
    assert.equal(sb.info.status, "paused");
    const again = await Sandbox.connect(sb.id, { controller: ctl });
    assert.equal(again.id, sb.id);
    assert.equal(again.info.status, "running");
    assert.notEqual(again.info.pid, oldPid);
    assert.equal((await again.files.read("/tmp/kept")).toString(), "from typescript");
    const first = Number((await again.files.read("/tmp/count")).toString());
    await sleep(1500);
    assert.ok(Number((await again.files.read("/tmp/count")).toString()) > first, "the process runs on");
    assert.ok((await again.commands.list()).some((p) => p.pid === counter.pid && p.running));
  });

  test("a timeout kills, an extended one does not", async () => {
    await using doomed = await Sandbox.create(TAG, { controller: ctl, timeoutSecs: 600 });
    await using kept = await Sandbox.create(TAG, { controller: ctl, timeoutSecs: 600 });
    await kept.setTimeout(2);
    await kept.setTimeout(600);
    await doomed.setTimeout(2);
    const deadline = Date.now() + 120_000;
    while ((await doomed.getInfo()).status === "running") {
      assert.ok(Date.now() < deadline, "the reaper did not end the sandbox");
      await sleep(500);
    }
    assert.equal(doomed.info.exit_reason, "timeout");
    assert.equal((await kept.getInfo()).status, "running");
  });
});
