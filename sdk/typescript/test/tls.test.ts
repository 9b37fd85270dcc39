/**
 * The Controller against `vmfork serve --tls-cert/--tls-key` (issue 17, item 3): a CA
 * and a server certificate made for the test (tests/tls_certs.py), a real daemon, and
 * node's own TLS stack verifying it.
 */

import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { after, before, describe, test } from "node:test";

import { Controller, ControllerError } from "../src/index.js";
import { startDaemon, type TestDaemon } from "./daemon.js";

const TOKEN = "test-token-0123456789abcdef";

describe("against vmfork serve over TLS", () => {
  let daemon: TestDaemon;
  before(async () => {
    daemon = await startDaemon({ token: TOKEN, tls: true });
  });
  after(async () => {
    await daemon?.stop();
  });

  test("the daemon's certificate is verified against the given CA", async () => {
    const url = daemon.tcpUrl as string;
    assert.match(url, /^https:\/\/127\.0\.0\.1:\d+$/);
    const byFile = new Controller({ baseUrl: url, token: TOKEN, caFile: daemon.caFile });
    assert.equal((await byFile.version()).api, "v1");
    assert.deepEqual(await byFile.listSandboxes(), []);
    const byPem = new Controller({ baseUrl: url, token: TOKEN, ca: readFileSync(daemon.caFile as string) });
    assert.equal((await byPem.healthz()).ok, true);
    const saved = process.env.VMFORK_CA_FILE;
    try {
      process.env.VMFORK_CA_FILE = daemon.caFile;
      assert.equal((await new Controller({ baseUrl: url, token: TOKEN }).healthz()).ok, true);
    } finally {
      if (saved === undefined) delete process.env.VMFORK_CA_FILE;
      else process.env.VMFORK_CA_FILE = saved;
    }
  });

  test("without the CA the certificate is refused, and the error says how to fix it", async () => {
    const ctl = new Controller({ baseUrl: daemon.tcpUrl, token: TOKEN, timeoutMs: 5000 });
    await assert.rejects(ctl.healthz(), (err: unknown) => {
      assert.ok(err instanceof ControllerError, String(err));
      assert.equal(err.status, 0);
      assert.match(err.reason, /does not trust.*VMFORK_CA_FILE/);
      return true;
    });
  });

  test("a plain-HTTP client gets no answer from the TLS port", async () => {
    const plain = new Controller({ baseUrl: (daemon.tcpUrl as string).replace("https:", "http:"), token: TOKEN, timeoutMs: 5000 });
    await assert.rejects(plain.healthz(), (err: unknown) => err instanceof ControllerError && err.status === 0);
  });
});
