/**
 * The Controller's image calls against a real `vmfork serve` whose image cache is
 * the test's own (`VMFORK_CACHE_DIR`, empty: no kernel, so builds are refused
 * before anything is built): request shaping (camelCase options, snake_case wire,
 * checked by the daemon's strict validation), the daemon's reasons, records
 * written into the cache as listed images, waiting, deleting. Real builds run in
 * the Python tests (tests/unit/test_server_images.py).
 */

import assert from "node:assert/strict";
import { mkdirSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import * as os from "node:os";
import * as path from "node:path";
import { after, before, describe, test } from "node:test";

import { Controller, ControllerError, ImageBuildFailedError } from "../src/index.js";
import { startDaemon, type TestDaemon } from "./daemon.js";

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

/** An image record as `vmfork.image.write_record` writes it (its files need not exist to be listed). */
function writeRecord(cache: string, name: string): void {
  mkdirSync(path.join(cache, "images"), { recursive: true });
  const record = {
    format: 2,
    name,
    kernel_key: "a".repeat(24),
    initramfs_key: "b".repeat(24),
    cmdline: "rdinit=/init",
    created: "2026-01-02T03:04:05+00:00",
    kernel_size: 1000,
    initrd_size: 2000,
    built_from: "default",
  };
  writeFileSync(path.join(cache, "images", `${name}.json`), JSON.stringify(record));
}

describe("images against vmfork serve (an empty image cache)", () => {
  let daemon: TestDaemon;
  let ctl: Controller;
  let scratch: string;

  before(async () => {
    scratch = mkdtempSync(path.join(os.tmpdir(), "vmfork-ts-images-"));
    mkdirSync(path.join(scratch, "cache"));
    daemon = await startDaemon({ env: { VMFORK_CACHE_DIR: path.join(scratch, "cache") } });
    ctl = new Controller({ baseUrl: daemon.socketUrl });
  });
  after(async () => {
    await daemon?.stop();
    rmSync(scratch, { recursive: true, force: true });
  });

  test("every option goes out snake_case and is accepted: the refusal is the missing kernel", async () => {
    const payload = path.join(scratch, "payload.txt");
    writeFileSync(payload, "hello");
    const err = await rejectsWith(
      ctl.buildImage("ts-image", {
        apt: ["curl"],
        pip: ["requests==2.32.3"],
        requirements: "numpy==2.0.2\n# a comment\n",
        pipIndexUrl: "https://pypi.org/simple",
        pipFindLinks: [scratch],
        pipNoIndex: false,
        npm: ["left-pad@1.3.0"],
        copy: [`${payload}:/opt/a.txt`, [payload, "/opt/b.txt"], { src: payload, dst: "/opt/c.txt" }],
        env: { GREETING: "hi" },
        workdir: "/opt",
        user: "1000:1000",
        diskFormat: "erofs",
        wait: false,
      }),
      409,
      /guest kernel is not built.*vmfork image build/,
    );
    assert.match(err.url, /\/v1\/images$/);
    assert.deepEqual(await ctl.listImages(), []);
  });

  test("bad options are 400 naming the wire field", async () => {
    await rejectsWith(ctl.buildImage("../escape"), 400, /'name' is not a valid image name/);
    await rejectsWith(ctl.buildImage("x", { diskFormat: "ext4" as "erofs" }), 400, /'disk_format' must be one of/);
    await rejectsWith(ctl.buildImage("x", { pipFindLinks: ["wheels"] }), 400, /'pip_find_links'/);
    await rejectsWith(ctl.buildImage("x", { pip: ["--index-url=http://evil"] }), 400, /pip: .* is not a requirement/);
    await rejectsWith(ctl.buildImage("x", { requirements: "-e git+https://x/y\n" }), 400, /'requirements', line 1/);
    await rejectsWith(ctl.buildImage("x", { copy: [["/nonexistent/vmfork", "/x"]] }), 400, /copy: \/nonexistent\/vmfork does not exist/);
    await rejectsWith(ctl.buildImage("x", { env: { "1BAD": "v" } }), 400, /env: '1BAD' is not a variable name/);
    await rejectsWith(ctl.importImage("x", "has a space"), 400, /'ref' must be an OCI reference/);
    assert.throws(() => ctl.buildImage("x", { copy: ["no-colon"] }), /not SRC:DST/);
  });

  test("unknown images and bases are 404; an import without the importer or kernel is refused", async () => {
    await rejectsWith(ctl.getImage("absent"), 404, /no image 'absent'/);
    await rejectsWith(ctl.deleteImage("absent"), 404, /no image 'absent'/);
    await rejectsWith(ctl.waitImage("absent"), 404, /no image 'absent'/);
    await rejectsWith(ctl.buildImage("child", { base: "absent", env: { A: "b" } }), 404, /field 'from'.*'absent'/);
    // 501 while the OCI importer is not part of the daemon, 409 (no kernel) once it is.
    await assert.rejects(ctl.importImage("imported", "oci-archive:/nonexistent.tar"), (err: unknown) => {
      assert.ok(err instanceof ControllerError, String(err));
      if (err.status === 501) assert.match(err.reason, /cannot import OCI images/);
      else assert.deepEqual([err.status, /guest kernel is not built/.test(err.reason)], [409, true], err.message);
      return true;
    });
  });

  test("an image in the cache is listed, waited for, fetched and deleted", async () => {
    writeRecord(path.join(scratch, "cache"), "recorded");
    const images = await ctl.listImages();
    assert.equal(images.length, 1);
    const listed = images[0]!;
    assert.equal(listed.name, "recorded");
    assert.equal(listed.status, "ready");
    assert.equal(listed.root, "initramfs");
    assert.equal(listed.size, 3000);
    assert.equal(listed.files_present, false);
    assert.equal(listed.created, "2026-01-02T03:04:05+00:00");
    assert.deepEqual(await ctl.waitImage("recorded", { timeoutMs: 1000 }), listed);
    assert.deepEqual(await ctl.getImage("recorded"), listed);
    await ctl.deleteImage("recorded");
    await rejectsWith(ctl.getImage("recorded"), 404, /no image 'recorded'/);
    assert.deepEqual(await ctl.listImages(), []);
  });

  test("ImageBuildFailedError is a 422 ControllerError carrying the job", () => {
    const err = new ImageBuildFailedError({ name: "x", status: "failed", error: "step apt: no such package" }, "unix:///s");
    assert.ok(err instanceof ControllerError);
    assert.equal(err.status, 422);
    assert.equal(err.reason, "step apt: no such package");
    assert.equal(err.info.name, "x");
  });
});
