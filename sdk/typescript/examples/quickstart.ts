/**
 * Spawn, drive, branch and kill sandboxes. Needs a running daemon and a snapshot:
 *
 *   vmfork serve &
 *   vmfork snapshot --tag py --warm 'answer = 41'     # or Controller.createSnapshot
 *   VMFORK_SNAPSHOT=py node sdk/typescript/build-test/examples/quickstart.js
 *
 * (built by `npx tsc -p tsconfig.test.json`; in your own project import from "vmfork").
 */

import { Controller, Sandbox } from "../src/index.js";

const tag = process.env.VMFORK_SNAPSHOT ?? "py";
const ctl = new Controller(); // $VMFORK_URL or the local daemon's socket; $VMFORK_TOKEN

{
  await using sb = await Sandbox.create(tag, { controller: ctl }); // killed when the block ends
  console.log("eval:", (await sb.eval("answer + 1")).result);

  await sb.commands.run("echo streamed; echo also >&2", {
    onStdout: (data) => process.stdout.write(`stdout: ${data}`),
    onStderr: (data) => process.stdout.write(`stderr: ${data}`),
  });
  for await (const { stream, data } of sb.commands.stream(["python3", "-c", "print(6 * 7)"])) {
    process.stdout.write(`${stream}: ${data}`);
  }

  await sb.files.write("/tmp/greeting.txt", "hello from the host\n");
  console.log("file:", (await sb.files.readText("/tmp/greeting.txt")).trim());

  await sb.eval("answer = 7");
  const snapshot = await sb.branch({ tag: `${tag}-branched`, mode: "full" });
  const [child] = await ctl.spawnSandboxes({ snapshotTag: snapshot.tag });
  console.log("child of the branch:", (await ctl.evalCode(child!.id, "answer")).result);
  await ctl.killSandbox(child!.id);
  await ctl.deleteSnapshot(snapshot.tag);
}
console.log("sandboxes left:", (await ctl.listSandboxes()).length);
