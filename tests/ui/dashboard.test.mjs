/**
 * The dashboard end to end (issue 18): Debian's chromium, driven by playwright-core,
 * against a real `vmfork serve` with real sandboxes (tests/ui/run.sh starts it and
 * makes the warm snapshot; in the emulated test host where the KVM cannot run guests).
 * Each view is screenshotted into $VMFORK_UI_ARTIFACTS.
 */

import assert from "node:assert/strict";
import { mkdirSync } from "node:fs";
import * as path from "node:path";
import { after, afterEach, before, describe, test } from "node:test";

import { chromium } from "playwright-core";

const URL_ = process.env.VMFORK_UI_URL;
const TOKEN = process.env.VMFORK_UI_TOKEN;
const SNAPSHOT = process.env.VMFORK_UI_SNAPSHOT;
const ARTIFACTS = process.env.VMFORK_UI_ARTIFACTS ?? path.resolve("ui-artifacts");
if (!URL_ || !TOKEN || !SNAPSHOT) throw new Error("run through tests/ui/run.sh (it sets VMFORK_UI_URL, _TOKEN, _SNAPSHOT)");
// Everything here runs in an emulated machine: generous, but bounded, waits.
const WAIT = { timeout: 180_000 };

async function api(method, route, json) {
  const response = await fetch(URL_ + route, {
    method,
    headers: { Authorization: `Bearer ${TOKEN}`, ...(json ? { "Content-Type": "application/json" } : {}) },
    body: json ? JSON.stringify(json) : undefined,
  });
  assert.ok(response.ok, `${method} ${route}: ${response.status} ${await response.clone().text()}`);
  return response.status === 204 ? null : response.json();
}

describe("the dashboard in a real browser", { timeout: 1_500_000 }, () => {
  let browser;
  let page;
  const pageErrors = [];
  const shot = (name) => page.screenshot({ path: path.join(ARTIFACTS, `${name}.png`), fullPage: true });

  before(async () => {
    mkdirSync(ARTIFACTS, { recursive: true });
    browser = await chromium.launch({
      executablePath: process.env.VMFORK_UI_CHROMIUM ?? "/usr/bin/chromium",
      // As root in a machine without a display: no sandbox (it needs user namespaces
      // for an unprivileged user), no background traffic to anywhere.
      args: ["--no-sandbox", "--disable-background-networking", "--disable-component-update",
             "--disable-default-apps", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
             "--disable-gpu"],
      timeout: 300_000,
    });
    page = await browser.newPage({ viewport: { width: 1280, height: 800 } });
    page.setDefaultTimeout(WAIT.timeout);
    page.on("pageerror", (err) => pageErrors.push(err.message));
  });

  afterEach(async (t) => {
    // What the page looked like when a step failed, beside the views' screenshots.
    if (t.passed === false && page) await shot(`failed-${t.name.replace(/[^a-z0-9]+/gi, "-").slice(0, 60)}`).catch(() => {});
  });

  after(async () => {
    await browser?.close();
    assert.deepEqual(pageErrors, [], "the page threw");
  });

  test("a wrong token is refused and the right one signs in, by keyboard alone", async () => {
    await page.goto(`${URL_}/ui`);
    const token = page.getByLabel("API token");
    await token.waitFor(WAIT);
    assert.equal(await page.evaluate(() => document.activeElement?.id), "token");
    await page.keyboard.type("not-the-token-0000000000");
    await page.keyboard.press("Enter");
    await page.getByRole("alert").filter({ hasText: "refused the token" }).waitFor(WAIT);
    await shot("login-refused");
    await token.fill("");
    await page.keyboard.type(TOKEN);
    await page.keyboard.press("Enter");
    await page.getByRole("heading", { name: "Sandboxes", exact: true }).waitFor(WAIT);
    // The token lives in the tab's session, never in the address.
    assert.ok(!page.url().includes(TOKEN));
    assert.equal(await page.evaluate(() => sessionStorage.getItem("vmfork.token")), TOKEN);
  });

  test("every control has an accessible name", async () => {
    const unnamed = await page.evaluate(() =>
      [...document.querySelectorAll("input, select, button, textarea")]
        .filter((e) => {
          const labelled = e.id && document.querySelector(`label[for="${e.id}"]`);
          return !(labelled || e.getAttribute("aria-label") || e.textContent.trim());
        })
        .map((e) => e.outerHTML.slice(0, 80)));
    assert.deepEqual(unnamed, []);
    assert.ok(await page.locator("main h2").count() >= 4);
  });

  let sandboxId;
  test("spawn from the form: the batch's progress, then the row in the live table", async () => {
    await page.getByLabel("Snapshot", { exact: true }).selectOption(SNAPSHOT, WAIT);
    await page.getByLabel("Count", { exact: true }).fill("2");
    await page.getByRole("button", { name: "Spawn", exact: true }).click();
    await page.locator(".batch").filter({ hasText: "2 of 2 ready" }).waitFor(WAIT);
    const rows = page.locator("#sandboxes tbody tr");
    await rows.nth(1).waitFor(WAIT);
    const listed = await api("GET", "/v1/sandboxes");
    assert.equal(listed.length, 2);
    sandboxId = listed[0].id;
    const row = page.locator(`#sandboxes tr[data-id="${sandboxId}"]`);
    await row.locator(".state", { hasText: "running" }).waitFor(WAIT);
    await shot("sandboxes");
  });

  test("a sandbox that ends changes state in the table without a reload", async () => {
    const listed = await api("GET", "/v1/sandboxes");
    const other = listed.find((s) => s.id !== sandboxId).id;
    // Its guest resets (the i8042 reset line ends the VMM): the table follows the
    // daemon's view of it.
    await api("POST", `/v1/sandboxes/${other}/exec`, { args: ["/bin/sh", "-c", "(sleep 1; reboot -f) >/dev/null 2>&1 &"] });
    await page.locator(`#sandboxes tr[data-id="${other}"] .state`).filter({ hasNotText: "running" }).waitFor(WAIT);
    await page.getByRole("button", { name: `kill ${other}` }).waitFor({ state: "detached", ...WAIT });
  });

  test("a branch appears in the snapshot tree under its parent", async () => {
    await page.getByLabel(`branch mode for ${sandboxId}`).selectOption("diff");
    await page.getByRole("button", { name: `branch ${sandboxId}` }).click();
    await page.getByRole("status").filter({ hasText: "branched" }).waitFor(WAIT);
    await page.getByRole("button", { name: "Snapshots", exact: true }).click();
    const parent = page.locator(`#snapshot-tree li[data-tag="${SNAPSHOT}"]`);
    const branch = parent.locator("ul li").filter({ hasText: `${sandboxId}-diff` });
    await branch.waitFor(WAIT);
    assert.match(await branch.innerText(), /branch \(diff\).*ready/);
    await shot("snapshots");
    // Pack it: the chain (and its image) downloads as vmfork unpack takes it.
    const downloaded = page.waitForEvent("download", WAIT);
    await branch.getByRole("button", { name: "pack", exact: false }).first().click();
    const file = await downloaded;
    assert.match(file.suggestedFilename(), /-diff-.*\.tar\.zst$/);
    await page.getByRole("status").filter({ hasText: "packed" }).waitFor(WAIT);
  });

  test("one sandbox: a command's output streams into the page, files, a terminal", async () => {
    await page.goto(`${URL_}/ui#sandbox/${sandboxId}`);
    await page.getByRole("heading", { name: `Sandbox ${sandboxId}` }).waitFor(WAIT);
    await page.getByLabel("Command (run with /bin/sh -c)").fill("echo first; sleep 3; echo second");
    await page.getByRole("button", { name: "Run", exact: true }).click();
    const out = page.getByLabel("command output");
    // Streamed: the first line is on the page while the command still sleeps.
    await out.filter({ hasText: "first" }).waitFor(WAIT);
    assert.ok(!(await out.innerText()).includes("second"), "the output arrived all at once");
    await out.filter({ hasText: "[exit 0]" }).waitFor(WAIT);
    assert.match(await out.innerText(), /first\s+second/);

    await page.getByLabel("Upload into it").setInputFiles({ name: "from-browser.txt", mimeType: "text/plain", buffer: Buffer.from("uploaded\n") });
    await page.locator("#files tbody tr").filter({ hasText: "from-browser.txt" }).waitFor(WAIT);
    const got = await api("POST", `/v1/sandboxes/${sandboxId}/exec`, { args: ["cat", "/tmp/from-browser.txt"] });
    assert.equal(got.stdout, "uploaded\n");

    await page.getByRole("button", { name: "Open a terminal", exact: true }).click();
    const term = page.getByLabel("terminal: focus it and type");
    await term.waitFor(WAIT);
    await term.filter({ hasText: "$" }).waitFor(WAIT);   // the shell's prompt: it reads now
    await term.focus();
    await page.keyboard.type("echo term-$((6*7))");
    await page.keyboard.press("Enter");
    await term.filter({ hasText: "term-42" }).waitFor(WAIT);

    // A child's console holds what its guest wrote since the restore (the boot was the
    // parent's): have it write a line there.
    await api("POST", `/v1/sandboxes/${sandboxId}/exec`, { args: ["/bin/sh", "-c", "echo console-says-hello > /dev/console"] });
    await page.getByRole("button", { name: "Refresh", exact: true }).click();
    await page.getByLabel("guest console log tail").filter({ hasText: "console-says-hello" }).waitFor(WAIT);
    await shot("sandbox");
  });

  test("kill from the table removes the row", async () => {
    await page.getByRole("button", { name: "Back to sandboxes", exact: true }).click();
    await page.getByRole("button", { name: `kill ${sandboxId}` }).click();
    await page.locator(`#sandboxes tr[data-id="${sandboxId}"]`).waitFor({ state: "detached", ...WAIT });
    const left = (await api("GET", "/v1/sandboxes")).filter((s) => s.id === sandboxId);
    assert.deepEqual(left, []);
  });

  test("charts draw the daemon's spawn latency", async () => {
    await page.getByRole("button", { name: "Charts", exact: true }).click();
    // Two samples five seconds apart with a spawn between them give a bar.
    await page.waitForTimeout(5500);
    await api("POST", "/v1/sandboxes", { snapshot_tag: SNAPSHOT, n: 1 });
    await page.locator("#chart-spawn rect").first().waitFor(WAIT);
    await shot("charts");
  });
});
