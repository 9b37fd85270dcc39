// vmfork's dashboard: plain ES module, no dependencies, served by the daemon at /ui.
//
// Every call goes to the daemon's own REST API (/v1, /metrics) on this origin with
// `Authorization: Bearer <token>`; the token is typed once and kept in
// sessionStorage (gone when the tab closes), never put in a URL. Live views poll on
// a fixed interval, one request in flight per view, stopped when the view is hidden.

const $ = (selector) => document.querySelector(selector);
const TOKEN_KEY = "vmfork.token";
const POLL_MS = 2000;
const CHART_MS = 5000;
const CHART_POINTS = 120;
const SPAWN_PARALLEL = 4;   // the daemon's default heavy-operation cap
const TERMINAL_MAX_CHARS = 200_000;
const METRICS_ROWS = 50;    // rows whose CPU and memory are asked for each poll (a bounded load)

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function api(method, path, { json, body, headers = {} } = {}) {
  const token = sessionStorage.getItem(TOKEN_KEY);
  const h = { Accept: "application/json", ...headers };
  if (token) h.Authorization = `Bearer ${token}`;
  if (json !== undefined) {
    h["Content-Type"] = "application/json";
    body = JSON.stringify(json);
  }
  const response = await fetch(path, { method, headers: h, body });
  if (response.status === 401) {
    showLogin(token ? "the daemon refused the token; sign in again" : "");
    throw new ApiError(401, "unauthorized");
  }
  if (!response.ok) {
    let reason = `${response.status}`;
    try {
      reason = (await response.json()).error ?? reason;
    } catch {
      // not JSON
    }
    throw new ApiError(response.status, reason);
  }
  return response;
}

const getJson = async (path) => (await api("GET", path)).json();

/** Server-sent events from a POST or GET response body: yields {event, data}. */
async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let event = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).trimStart());
      }
      if (data.length) yield { event, data: JSON.parse(data.join("\n")) };
    }
  }
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "onclick") node.addEventListener("click", v);
    else if (v !== undefined && v !== null) node.setAttribute(k, v);
  }
  for (const child of children) node.append(child instanceof Node ? child : String(child));
  return node;
}

function age(unix) {
  const s = Math.max(0, Date.now() / 1000 - unix);
  if (s < 90) return `${Math.round(s)} s`;
  if (s < 5400) return `${Math.round(s / 60)} min`;
  return `${(s / 3600).toFixed(1)} h`;
}

const mib = (bytes) => `${(bytes / 1048576).toFixed(1)} MiB`;

// -- views -----------------------------------------------------------------------

const views = ["sandboxes", "snapshots", "charts", "sandbox"];
let current = null;
const pollers = {};

function show(view, arg) {
  current = view;
  $("#login").hidden = true;
  for (const v of views) $(`#view-${v}`).hidden = v !== view;
  for (const b of document.querySelectorAll("nav button")) {
    if (b.dataset.view === view) b.setAttribute("aria-current", "page");
    else b.removeAttribute("aria-current");
  }
  for (const [name, p] of Object.entries(pollers)) if (name !== view) p.stop();
  if (view === "sandbox") openSandbox(arg);
  else pollers[view]?.start();
}

function showLogin(message = "") {
  current = null;
  for (const p of Object.values(pollers)) p.stop();
  for (const v of views) $(`#view-${v}`).hidden = true;
  $("#login").hidden = false;
  $("#logout").hidden = true;
  $("#login-error").textContent = message;
  $("#token").focus();
}

/** Runs `tick` every `ms` while started; never two at once. */
function poller(tick, ms) {
  let timer = null;
  let running = false;
  const loop = async () => {
    if (!running) return;
    try {
      await tick();
    } finally {
      if (running) timer = setTimeout(loop, ms);
    }
  };
  return {
    start() {
      if (running) return;
      running = true;
      loop();
    },
    stop() {
      running = false;
      clearTimeout(timer);
    },
  };
}

// -- sandboxes -------------------------------------------------------------------

const metricsCache = new Map();   // id -> {cpu, mem} from /v1/sandboxes/{id}/metrics, if served

async function sandboxMetrics(id) {
  if (metricsCache.get(id) === "none") return null;
  try {
    const m = await getJson(`/v1/sandboxes/${encodeURIComponent(id)}/metrics?disk=false`);
    return m;
  } catch (err) {
    if (err.status === 404 || err.status === 405) metricsCache.set(id, "none");   // an older daemon
    return null;
  }
}

async function refreshSandboxes() {
  const tbody = $("#sandboxes tbody");
  let list;
  try {
    list = await getJson("/v1/sandboxes");
    $("#sandboxes-error").textContent = "";
  } catch (err) {
    $("#sandboxes-error").textContent = `cannot list sandboxes: ${err.message}`;
    return;
  }
  const rows = await Promise.all(list.map(async (s, i) => {
    const m = s.status === "running" && i < METRICS_ROWS ? await sandboxMetrics(s.id) : null;
    const cells = [
      s.snapshot_tag,
      s.status,
      age(s.created_at_unix),
      m?.memory_private_dirty_bytes != null ? mib(m.memory_private_dirty_bytes) : "—",
      m?.cpu_seconds != null ? `${m.cpu_seconds.toFixed(2)} s` : "—",
      s.network ? [s.guest_addr, ...(s.network.ports ?? []).map((p) => `:${p.host_port ?? p}`)].filter(Boolean).join(" ") : "none",
      s.end_at_unix ? `until ${new Date(s.end_at_unix * 1000).toLocaleTimeString()}` : "no limit",
    ];
    // A row whose cells did not change is kept as it is: a redraw would take the
    // keyboard focus and a half-made choice (the branch mode) from under the user.
    const signature = JSON.stringify(cells.filter((_, i) => i !== 2));   // all but the age
    const existing = tbody.querySelector(`tr[data-id="${CSS.escape(s.id)}"]`);
    if (existing?.dataset.signature === signature) {
      existing.cells[3].textContent = cells[2];
      return existing;
    }
    const actions = el("td", {});
    if (s.status === "running") {
      actions.append(
        el("button", { type: "button", "aria-label": `kill ${s.id}`, onclick: () => killSandbox(s.id) }, "Kill"),
        " ",
        el("label", { for: `mode-${s.id}`, class: "visually-hidden" }, `branch mode for ${s.id}`),
        el("select", { id: `mode-${s.id}` }, el("option", { value: "diff" }, "diff"), el("option", { value: "full" }, "full"), el("option", { value: "live" }, "live")),
        el("button", { type: "button", "aria-label": `branch ${s.id}`, onclick: () => branchSandbox(s.id, $(`#mode-${s.id}`).value) }, "Branch"),
      );
    }
    const [snapshot, state, ...rest] = cells;
    return el("tr", { "data-id": s.id, "data-signature": signature },
      el("td", {}, el("a", { href: `#sandbox/${s.id}` }, s.id)),
      el("td", {}, snapshot),
      el("td", { class: `state ${state}` }, state),
      ...rest.map((c) => el("td", {}, c)),
      actions);
  }));
  // Rows already in place stay put (moving one, even to where it was, would blur it).
  rows.forEach((row, i) => {
    if (tbody.children[i] !== row) tbody.insertBefore(row, tbody.children[i] ?? null);
  });
  while (tbody.children.length > rows.length) tbody.lastElementChild.remove();
}

async function killSandbox(id) {
  try {
    await api("DELETE", `/v1/sandboxes/${encodeURIComponent(id)}`);
  } catch (err) {
    $("#sandboxes-error").textContent = `kill ${id}: ${err.message}`;
  }
  await refreshSandboxes();
}

async function branchSandbox(id, mode) {
  const tag = `${id}-${mode}-${Date.now().toString(36)}`;
  try {
    await api("POST", `/v1/sandboxes/${encodeURIComponent(id)}/branch`, { json: { tag, mode } });
    $("#sandboxes-status").textContent = `branched ${id} into snapshot ${tag}`;
  } catch (err) {
    $("#sandboxes-error").textContent = `branch ${id}: ${err.message}`;
  }
}

async function refreshSnapshotChoices() {
  const select = $("#spawn-tag");
  const chosen = select.value;
  try {
    const snaps = (await getJson("/v1/snapshots")).filter((s) => s.bootable);
    select.replaceChildren(...snaps.map((s) => el("option", { value: s.tag }, s.tag)));
    if (chosen) select.value = chosen;
  } catch {
    // the table's poll reports the daemon's state
  }
}

/** N spawns, at most SPAWN_PARALLEL in flight, with a progress bar per batch. */
async function spawnBatch(tag, n) {
  const id = `batch-${Date.now().toString(36)}`;
  const bar = el("progress", { max: n, value: 0, id, "aria-label": `spawning ${n} from ${tag}` });
  const text = el("span", {}, `0 of ${n} ready`);
  const row = el("div", { class: "batch" }, `${n} × ${tag}: `, bar, " ", text);
  $("#spawn-batches").prepend(row);
  let ready = 0;
  let failed = 0;
  let next = 0;
  const errors = new Set();
  const worker = async () => {
    while (next < n) {
      next += 1;
      try {
        await api("POST", "/v1/sandboxes", { json: { snapshot_tag: tag, n: 1 } });
        ready += 1;
      } catch (err) {
        failed += 1;
        errors.add(err.message);
      }
      bar.value = ready + failed;
      text.textContent = `${ready} of ${n} ready${failed ? `, ${failed} failed (${[...errors].join("; ")})` : ""}`;
    }
  };
  await Promise.all(Array.from({ length: Math.min(SPAWN_PARALLEL, n) }, worker));
  row.classList.add(failed ? "failed" : "done");
}

// -- snapshots -------------------------------------------------------------------

async function refreshSnapshots() {
  let snaps;
  try {
    snaps = await getJson("/v1/snapshots");
    $("#snapshots-error").textContent = "";
  } catch (err) {
    $("#snapshots-error").textContent = `cannot list snapshots: ${err.message}`;
    return;
  }
  const sandboxes = await getJson("/v1/sandboxes").catch(() => []);
  const users = new Map();
  for (const s of sandboxes) if (s.status === "running") users.set(s.snapshot_tag, (users.get(s.snapshot_tag) ?? 0) + 1);
  const byTag = new Map(snaps.map((s) => [s.tag, { ...s, children: [] }]));
  const roots = [];
  for (const node of byTag.values()) {
    const parent = node.parent_tag ?? node.branched_from;
    if (parent && byTag.has(parent) && parent !== node.tag) byTag.get(parent).children.push(node);
    else roots.push(node);
  }
  const infos = new Map();
  await Promise.all([...byTag.values()].filter((s) => s.status === "ready").map(async (s) => {
    try {
      infos.set(s.tag, await getJson(`/v1/snapshots/${encodeURIComponent(s.tag)}/info`));
    } catch {
      // listed but gone: shown without sizes
    }
  }));
  const render = (node) => {
    const info = infos.get(node.tag);
    // A BRANCH of a running sandbox says its mode (a diff one also has a parent_tag);
    // a link made another way (snapshot-diff, a pull) is a plain diff link.
    const kind = node.branch_mode ? `branch (${node.branch_mode})` : node.parent_tag ? "diff link" : "root";
    const details = [kind, node.status];
    if (info) details.push(`disk ${mib(info.unique_bytes ?? info.physical_bytes ?? 0)}`, `layer ${mib(info.layer_bytes ?? 0)}`);
    if (node.compacted_from || info?.compacted_from) details.push("compacted");
    const used = users.get(node.tag) ?? 0;
    if (used) details.push(`${used} sandbox${used > 1 ? "es" : ""}`);
    const label = el("span", { class: `node ${node.status}` }, el("strong", {}, node.tag), ` — ${details.join(" · ")}`);
    const del = el("button", { type: "button", "aria-label": `delete ${node.tag}`, onclick: () => deleteSnapshot(node.tag) }, "Delete");
    const compact = node.parent_tag ? el("button", { type: "button", "aria-label": `compact ${node.tag}`, onclick: () => compactSnapshot(node.tag) }, "Compact") : "";
    const pack = node.status === "ready" ? el("button", { type: "button", "aria-label": `pack ${node.tag}`, onclick: () => packSnapshot(node.tag) }, "Pack") : "";
    const item = el("li", { "data-tag": node.tag }, label, " ", del, " ", compact, " ", pack);
    if (node.children.length) item.append(el("ul", {}, ...node.children.map(render)));
    return item;
  };
  $("#snapshot-tree").replaceChildren(...roots.map(render));
}

async function deleteSnapshot(tag) {
  try {
    await api("DELETE", `/v1/snapshots/${encodeURIComponent(tag)}`);
  } catch (err) {
    // 409 (dependents or users): say so and offer the API's cascade.
    if (err.status === 409 && confirm(`${err.message}\n\nDelete ${tag} and everything that depends on it?`)) {
      try {
        await api("DELETE", `/v1/snapshots/${encodeURIComponent(tag)}?cascade=true`);
      } catch (err2) {
        $("#snapshots-error").textContent = `delete ${tag}: ${err2.message}`;
      }
    } else {
      $("#snapshots-error").textContent = `delete ${tag}: ${err.message}`;
    }
  }
  await refreshSnapshots();
}

/** The chain as a pack (`vmfork unpack` takes it on another host), downloaded. */
async function packSnapshot(tag) {
  $("#snapshots-status").textContent = `packing ${tag}…`;
  try {
    const blob = await (await api("GET", `/v1/snapshots/${encodeURIComponent(tag)}/pack`, { headers: { Accept: "application/zstd" } })).blob();
    saveBlob(blob, `${tag}.tar.zst`);
    $("#snapshots-status").textContent = `packed ${tag}: ${mib(blob.size)}`;
  } catch (err) {
    $("#snapshots-status").textContent = "";
    $("#snapshots-error").textContent = `pack ${tag}: ${err.message}`;
  }
}

function saveBlob(blob, name) {
  const url = URL.createObjectURL(blob);
  const a = el("a", { href: url, download: name });
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10_000);
}

async function compactSnapshot(tag) {
  const to = `${tag}-flat`;
  try {
    await api("POST", `/v1/snapshots/${encodeURIComponent(tag)}/compact`, { json: { to } });
  } catch (err) {
    $("#snapshots-error").textContent = `compact ${tag}: ${err.message}`;
  }
  await refreshSnapshots();
}

// -- charts ----------------------------------------------------------------------

const samples = { spawn: [], pause: [] };
let lastTotals = null;

function histogramTotals(text, name) {
  let sum = 0;
  let count = 0;
  for (const line of text.split("\n")) {
    if (line.startsWith(`${name}_sum`)) sum += Number(line.split(" ").pop());
    else if (line.startsWith(`${name}_count`)) count += Number(line.split(" ").pop());
  }
  return { sum, count };
}

function drawChart(svg, points) {
  const w = 600;
  const h = 160;
  const max = Math.max(1, ...points.map((p) => p ?? 0));
  const label = document.createElementNS("http://www.w3.org/2000/svg", "text");
  label.setAttribute("x", "4");
  label.setAttribute("y", "14");
  label.textContent = `max ${max.toFixed(1)} ms over the last ${points.length} samples`;
  const parts = [label];
  const step = w / CHART_POINTS;
  points.forEach((p, i) => {
    if (p == null) return;
    const bh = (p / max) * (h - 24);
    const rect = document.createElementNS("http://www.w3.org/2000/svg", "rect");
    rect.setAttribute("x", String(i * step));
    rect.setAttribute("y", String(h - bh));
    rect.setAttribute("width", String(Math.max(1, step - 1)));
    rect.setAttribute("height", String(bh));
    parts.push(rect);
  });
  svg.replaceChildren(...parts);
}

async function sampleMetrics() {
  let text;
  try {
    text = await (await api("GET", "/metrics", { headers: { Accept: "text/plain" } })).text();
    $("#charts-error").textContent = "";
  } catch (err) {
    $("#charts-error").textContent = `cannot read /metrics: ${err.message}`;
    return;
  }
  const totals = { spawn: histogramTotals(text, "vmfork_spawn_seconds"), pause: histogramTotals(text, "vmfork_branch_pause_seconds") };
  if (lastTotals) {
    for (const key of ["spawn", "pause"]) {
      const dc = totals[key].count - lastTotals[key].count;
      const ds = totals[key].sum - lastTotals[key].sum;
      samples[key].push(dc > 0 ? (ds / dc) * 1000 : null);
      if (samples[key].length > CHART_POINTS) samples[key].shift();
    }
  }
  lastTotals = totals;
  drawChart($("#chart-spawn"), samples.spawn);
  drawChart($("#chart-pause"), samples.pause);
}

// -- one sandbox -----------------------------------------------------------------

let sandboxId = null;
let terminal = null;   // {pid, abort}

function openSandbox(id) {
  sandboxId = id;
  $("#sandbox-title").textContent = `Sandbox ${id}`;
  $("#exec-output").textContent = "";
  $("#sandbox-error").textContent = "";
  closeTerminal();
  listFiles();
  refreshConsole();
  $("#exec-cmd").focus();
}

const base = () => `/v1/sandboxes/${encodeURIComponent(sandboxId)}`;

async function runCommand(cmd) {
  const out = $("#exec-output");
  out.textContent = "";
  try {
    const response = await api("POST", `${base()}/exec/stream`, { json: { args: ["/bin/sh", "-c", cmd], timeout_secs: 600 } });
    for await (const { event, data } of events(response)) {
      if (event === "stdout" || event === "stderr") {
        out.append(el("span", { class: event }, data.data));
      } else if (event === "exit") {
        out.append(el("span", { class: "exit" }, `\n[exit ${data.exit_code}${data.signal ? `, signal ${data.signal}` : ""}]\n`));
      } else if (event === "error") {
        out.append(el("span", { class: "stderr" }, `\n[${data.error}]\n`));
      }
    }
  } catch (err) {
    $("#sandbox-error").textContent = `run: ${err.message}`;
  }
}

async function listFiles() {
  const dir = $("#files-path").value;
  const tbody = $("#files tbody");
  try {
    const r = await getJson(`${base()}/files/list?path=${encodeURIComponent(dir)}`);
    const entries = r.entries ?? r;
    tbody.replaceChildren(...entries.map((e) => {
      const full = `${dir.replace(/\/$/, "")}/${e.name}`;
      const dl = e.type === "file" ? el("button", { type: "button", "aria-label": `download ${e.name}`, onclick: () => download(full, e.name) }, "Download") : "";
      return el("tr", {}, el("td", {}, e.name), el("td", {}, e.type), el("td", {}, e.size ?? ""), el("td", {}, dl));
    }));
  } catch (err) {
    $("#sandbox-error").textContent = `list ${dir}: ${err.message}`;
  }
}

async function download(path, name) {
  try {
    const blob = await (await api("GET", `${base()}/files?path=${encodeURIComponent(path)}`, { headers: { Accept: "*/*" } })).blob();
    saveBlob(blob, name);
  } catch (err) {
    $("#sandbox-error").textContent = `download ${path}: ${err.message}`;
  }
}

async function upload(file) {
  const dir = $("#files-path").value.replace(/\/$/, "");
  try {
    await api("PUT", `${base()}/files?path=${encodeURIComponent(`${dir}/${file.name}`)}`, {
      body: file,
      headers: { "Content-Type": "application/octet-stream" },
    });
    await listFiles();
  } catch (err) {
    $("#sandbox-error").textContent = `upload ${file.name}: ${err.message}`;
  }
}

async function refreshConsole() {
  try {
    const text = await (await api("GET", `${base()}/console?tail=16384`, { headers: { Accept: "text/plain" } })).text();
    $("#console").textContent = text || "(empty: the guest wrote nothing to its console since this sandbox started; a forked sandbox's boot messages are its parent's)";
  } catch (err) {
    $("#console").textContent = `(console not available: ${err.message})`;
  }
}

// ANSI control sequences are dropped, not interpreted: a log-style terminal.
const ANSI = /\x1b\[[0-9;?]*[ -\/]*[@-~]|\x1b\][^\x07]*\x07|\x1b[()][0-9A-Za-z]|\r/g;

async function openTerminal() {
  closeTerminal();
  const pre = $("#terminal");
  pre.textContent = "";
  try {
    const r = await (await api("POST", `${base()}/processes`, { json: { args: ["/bin/sh", "-i"], pty: { rows: 24, cols: 100 }, env: { TERM: "dumb", PS1: "$ " } } })).json();
    const abort = new AbortController();
    terminal = { pid: r.pid, abort };
    // Shown (and focusable) only once its shell runs: nothing typed is lost.
    pre.hidden = false;
    pre.focus();
    const token = sessionStorage.getItem(TOKEN_KEY);
    const response = await fetch(`${base()}/processes/${r.pid}/output?offset=0`, {
      headers: token ? { Authorization: `Bearer ${token}` } : {},
      signal: abort.signal,
    });
    for await (const { event, data } of events(response)) {
      if (event === "exit") {
        pre.append(`\n[exit ${data.exit_code}]\n`);
        break;
      }
      if (data.data !== undefined) {
        pre.append(String(data.data).replace(ANSI, ""));
        if (pre.textContent.length > TERMINAL_MAX_CHARS) pre.textContent = pre.textContent.slice(-TERMINAL_MAX_CHARS / 2);
        pre.scrollTop = pre.scrollHeight;
      }
    }
  } catch (err) {
    if (err.name !== "AbortError") $("#sandbox-error").textContent = `terminal: ${err.message}`;
  }
}

function closeTerminal() {
  if (terminal) {
    terminal.abort.abort();
    api("POST", `${base()}/processes/${terminal.pid}/signal`, { json: { signal: "SIGKILL" } }).catch(() => {});
    terminal = null;
  }
  $("#terminal").hidden = true;
}

// Keystrokes go out one request at a time, in order.
let terminalInput = Promise.resolve();

function terminalKey(event) {
  if (!terminal) return;
  let data = null;
  if (event.key === "Enter") data = "\n";
  else if (event.key === "Backspace") data = "\x7f";
  else if (event.key === "Tab") data = "\t";
  else if (event.ctrlKey && event.key.length === 1) data = String.fromCharCode(event.key.toUpperCase().charCodeAt(0) - 64);
  else if (event.key.length === 1) data = event.key;
  if (data === null) return;
  event.preventDefault();
  const route = `${base()}/processes/${terminal.pid}/stdin`;
  terminalInput = terminalInput.then(() =>
    api("POST", route, { body: data, headers: { "Content-Type": "application/octet-stream" } }).catch((err) => {
      $("#sandbox-error").textContent = `terminal input: ${err.message}`;
    }));
}

// -- start -----------------------------------------------------------------------

async function signIn(token) {
  sessionStorage.setItem(TOKEN_KEY, token);
  try {
    await getJson("/v1/sandboxes");
  } catch (err) {
    sessionStorage.removeItem(TOKEN_KEY);
    if (err.status !== 401) showLogin(`the daemon did not answer: ${err.message}`);
    return false;
  }
  $("#logout").hidden = false;
  try {
    const v = await getJson("/version");
    $("#daemon").textContent = `vmfork ${v.version ?? ""} · API ${v.api ?? ""}`;
  } catch {
    $("#daemon").textContent = "";
  }
  route();
  return true;
}

function route() {
  const [view, arg] = location.hash.replace(/^#/, "").split("/");
  if (view === "sandbox" && arg) show("sandbox", decodeURIComponent(arg));
  else show(views.includes(view) && view !== "sandbox" ? view : "sandboxes");
}

async function start() {
  pollers.sandboxes = poller(async () => {
    await refreshSandboxes();
    await refreshSnapshotChoices();
  }, POLL_MS);
  pollers.snapshots = poller(refreshSnapshots, POLL_MS * 2);
  pollers.charts = poller(sampleMetrics, CHART_MS);
  for (const b of document.querySelectorAll("nav button")) {
    b.addEventListener("click", () => {
      location.hash = b.dataset.view;
    });
  }
  window.addEventListener("hashchange", () => current && route());
  $("#login-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    const ok = await signIn($("#token").value.trim());
    if (ok) $("#token").value = "";
  });
  $("#logout").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    showLogin();
  });
  $("#spawn-form").addEventListener("submit", (e) => {
    e.preventDefault();
    spawnBatch($("#spawn-tag").value, Number($("#spawn-n").value));
  });
  $("#exec-form").addEventListener("submit", (e) => {
    e.preventDefault();
    runCommand($("#exec-cmd").value);
  });
  $("#files-form").addEventListener("submit", (e) => {
    e.preventDefault();
    listFiles();
  });
  $("#upload").addEventListener("change", (e) => {
    const file = e.target.files[0];
    if (file) upload(file);
  });
  $("#back").addEventListener("click", () => {
    location.hash = "sandboxes";
  });
  $("#term-open").addEventListener("click", openTerminal);
  $("#terminal").addEventListener("keydown", terminalKey);
  $("#console-refresh").addEventListener("click", refreshConsole);
  // A daemon without a token (its Unix socket, or loopback) lets us straight in.
  if (!(await signIn(sessionStorage.getItem(TOKEN_KEY) ?? "")) && $("#login").hidden) showLogin();
}

start();
