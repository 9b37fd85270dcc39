"""E2B's control plane (the API its SDKs reach at ``E2B_API_URL``, ``api.<domain>``)
translated onto vmfork's controller: templates are snapshot tags, a sandbox is a
vmfork sandbox, and the key in ``X-API-KEY`` is the daemon's bearer token.

Each route checks E2B's body, makes the controller's own request of it and calls
the controller's method for it (create → ``create_sandboxes``, ``…/timeout`` →
``set_timeout``, ``…/connect`` → ``connect_sandbox``, ``…/pause`` →
``pause_sandbox``, fork → ``branch_sandbox`` then ``create_sandboxes``, metrics →
``sandbox_metrics``), then answers in E2B's shapes: a translator onto the
controller, with no lifecycle of its own.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from typing import Any

from vmfork.server import api
from vmfork.server.controller import PAUSE_TAG_PREFIX, Controller
from vmfork.server.controller.usage import cpu_used_pct
from vmfork.server.e2b.envd import ENVD_VERSION
from vmfork.server.errors import ApiError, BadRequest
from vmfork.server.requests import Branch, SandboxCreate
from vmfork.server.validation import (
    Field,
    between,
    check_string_map,
    check_tag,
    parse_json_object,
    parse_query,
    validate_fields,
)

CLIENT_ID = "vmfork"
MAX_TIMEOUT_SECS = 30 * 86400
MAX_LIST_LIMIT = 1000
MAX_METADATA = 64

NEW_SANDBOX = {
    "templateID": Field(str, check=check_tag),
    "timeout": Field(int, None, between(0, MAX_TIMEOUT_SECS), nullable=True),
    "metadata": Field(dict, None, check_string_map, nullable=True),
    "envVars": Field(dict, None, check_string_map, nullable=True),
    "autoPause": Field(bool, None, nullable=True),
    "autoPauseMemory": Field(bool, None, nullable=True),
    "autoResume": Field(dict, None, nullable=True),
    "secure": Field(bool, None, nullable=True),
    "allow_internet_access": Field(bool, None, nullable=True),
    "network": Field(dict, None, nullable=True),
    "mcp": Field(dict, None, nullable=True),
    "iam": Field(dict, None, nullable=True),
    "volumeMounts": Field(list, None, nullable=True),
}
"""The fields of E2B's ``NewSandbox``; unknown ones are refused, as by vmfork's API."""
TIMEOUT = {"timeout": Field(int, check=between(0, MAX_TIMEOUT_SECS))}
CONNECT = {"timeout": Field(int, None, between(0, MAX_TIMEOUT_SECS), nullable=True),
           "memory": Field(str, None, nullable=True)}
RESUME = {"timeout": Field(int, None, between(0, MAX_TIMEOUT_SECS), nullable=True),
          "autoPause": Field(bool, None, nullable=True)}
REFRESH = {"duration": Field(int, None, between(0, 3600), nullable=True)}
MAX_FORK_COUNT = 20
SNAPSHOT = {"name": Field(str, None, check_tag, nullable=True),
            "memory": Field(bool, None, nullable=True)}
"""E2B's ``SandboxSnapshotRequest``."""
FORK = {"timeout": Field(int, None, between(0, MAX_TIMEOUT_SECS), nullable=True),
        "count": Field(int, 1, between(1, MAX_FORK_COUNT))}


class Tokens:
    """Per-sandbox envd access tokens: an HMAC of the sandbox id under the daemon's
    key, so any daemon with the same key (a restarted one) checks them without
    storing them, and one sandbox's token opens no other."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    def for_sandbox(self, sandbox_id: str) -> str:
        return hmac.new(self._key, b"envd:" + sandbox_id.encode(), hashlib.sha256).hexdigest()

    def check(self, sandbox_id: str, given: str | None) -> bool:
        return given is not None and hmac.compare_digest(
            given.encode("utf-8", "surrogateescape"), self.for_sandbox(sandbox_id).encode())


def _body(req: api.Request, spec: dict[str, Field], where: str) -> dict[str, Any]:
    raw = req.read_all(api.MAX_JSON_BODY, where, "the JSON body")
    return validate_fields(parse_json_object(raw or b"{}", where), spec, where)


def _domain(req: api.Request) -> str | None:
    """The sandbox domain to hand out: ``<domain>`` when the client reached this daemon
    as ``api.<domain>`` (so envd is ``49983-<id>.<domain>``), else None (the SDK then
    uses its own setting: ``E2B_SANDBOX_URL`` or ``E2B_DOMAIN``)."""
    host = req.headers.get("host", "").rsplit(":", 1)[0] if "]" not in req.headers.get(
        "host", "") else ""
    return host[4:] if host.startswith("api.") and len(host) > 4 else None


class ControlPlane:
    def __init__(self, tokens: Tokens) -> None:
        self.tokens = tokens

    def _sandbox(self, c: Controller, info: dict[str, Any], req: api.Request) -> dict[str, Any]:
        """E2B's ``Sandbox`` (what create, connect and resume answer)."""
        return {"templateID": info["snapshot_tag"], "sandboxID": info["id"],
                "clientID": CLIENT_ID, "envdVersion": ENVD_VERSION,
                "envdAccessToken": self.tokens.for_sandbox(info["id"]),
                # The code interpreter's SDK sends only this one on its context calls.
                "trafficAccessToken": self.tokens.for_sandbox(info["id"]),
                "domain": _domain(req)}

    def _listed(self, c: Controller, info: dict[str, Any], sizes: dict[str, Any]
                ) -> dict[str, Any]:
        """E2B's ``ListedSandbox``."""
        tag = info["snapshot_tag"]
        if tag not in sizes:
            try:
                sizes[tag] = c.snapshot_info(tag)
            except ApiError:
                sizes[tag] = {}
        snapshot = sizes[tag]
        started = float(info.get("created_at_unix") or 0)
        end_at = info.get("end_at_unix")
        state = "paused" if info.get("status") == "paused" else "running"
        return {"sandboxID": info["id"], "templateID": tag, "clientID": CLIENT_ID,
                "startedAt": _iso(started),
                "endAt": _iso(float(end_at)) if end_at else _iso(started + 100 * 365 * 86400),
                "cpuCount": int(snapshot.get("vcpus") or 1),
                "memoryMB": int(info.get("memory_limit_mib") or snapshot.get("mem_mib") or 0),
                "diskSizeMB": 0, "envdVersion": ENVD_VERSION, "state": state,
                "metadata": info.get("metadata") or {}}

    # -- routes ------------------------------------------------------------------------

    def create(self, c: Controller, req: api.Request) -> api.Response:
        where = f"{req.method} {req.path}"
        body = _body(req, NEW_SANDBOX, where)
        for name in ("mcp", "iam", "volumeMounts", "autoResume"):
            if body[name]:
                raise BadRequest(f"{where}: {name} is not supported by vmfork")
        if body["network"]:
            raise BadRequest(f"{where}: network rules are not supported here; leave "
                             "network out (vmfork's own API has egress policies)")
        spawn: dict[str, Any] = {"snapshot_tag": body["templateID"]}
        if body["allow_internet_access"] is False:
            spawn.update(per_child_netns=True, egress={"mode": "deny"})
        lifecycle = {}
        if body["timeout"]:
            lifecycle["timeout_secs"] = body["timeout"]
            lifecycle["on_timeout"] = "pause" if body["autoPause"] else "kill"
        if body["metadata"]:
            if len(body["metadata"]) > MAX_METADATA:
                raise BadRequest(f"{where}: more than {MAX_METADATA} metadata entries")
            lifecycle["metadata"] = body["metadata"]
        if body["envVars"]:
            lifecycle["envs"] = body["envVars"]
        spawn.update(lifecycle)
        spawn = validate_fields(spawn, api.SANDBOX_CREATE, where)
        req.snapshot_tag = body["templateID"]
        [info] = c.create_sandboxes(SandboxCreate.of(spawn))
        req.sandbox_ids = [info["id"]]
        return api.Response(201, self._sandbox(c, info, req))

    def list(self, c: Controller, req: api.Request) -> api.Response:
        where = f"{req.method} {req.path}"
        q = parse_query(req.query, {
            "metadata": Field(str, None, nullable=True), "state": Field(str, None,
                                                                      nullable=True),
            "limit": Field(int, None, between(1, MAX_LIST_LIMIT), nullable=True),
            "nextToken": Field(str, None, nullable=True),
            "order": Field(str, None, nullable=True),
            "template": Field(str, None, nullable=True),
            "startedAfter": Field(str, None, nullable=True)}, where)
        wanted_meta = _metadata_query(q["metadata"], where)
        states = set(q["state"].split(",")) if q["state"] else {"running", "paused"}
        if not states <= {"running", "paused"}:
            raise BadRequest(f"{where}: state is running and/or paused")
        sizes: dict[str, Any] = {}
        listed = [self._listed(c, i, sizes) for i in c.list_sandboxes()
                  if i.get("status") in ("running", "paused")]
        listed = [s for s in listed if s["state"] in states
                  and all(s["metadata"].get(k) == v for k, v in wanted_meta.items())
                  and (q["template"] is None or s["templateID"] == q["template"])]
        listed.sort(key=lambda s: (s["startedAt"], s["sandboxID"]),
                    reverse=q["order"] == "desc")
        page, headers = _page(listed, q, where)
        return api.Response(200, page, headers=headers)

    def get(self, c: Controller, req: api.Request) -> api.Response:
        info = c.get_sandbox(_id(req))
        detail = self._listed(c, info, {})
        detail.update(envdAccessToken=self.tokens.for_sandbox(info["id"]), domain=_domain(req))
        return api.Response(200, detail)

    def kill(self, c: Controller, req: api.Request) -> api.Response:
        c.delete_sandbox(_id(req))
        return api.Response(204)

    def set_timeout(self, c: Controller, req: api.Request) -> api.Response:
        sandbox_id = _id(req)
        body = _body(req, TIMEOUT, f"{req.method} {req.path}")
        c.set_timeout(sandbox_id, body["timeout"] or None)
        return api.Response(204)

    def refresh(self, c: Controller, req: api.Request) -> api.Response:
        sandbox_id = _id(req)
        body = _body(req, REFRESH, f"{req.method} {req.path}")
        if body["duration"]:
            c.connect_sandbox(sandbox_id, body["duration"])
        else:
            c.get_sandbox(sandbox_id)
        return api.Response(204)

    def connect(self, c: Controller, req: api.Request) -> api.Response:
        sandbox_id = _id(req)
        body = _body(req, CONNECT, f"{req.method} {req.path}")
        info = c.connect_sandbox(sandbox_id, body["timeout"] or None)
        return api.Response(200, self._sandbox(c, info, req))

    def pause(self, c: Controller, req: api.Request) -> api.Response:
        sandbox_id = _id(req)
        _body(req, {}, f"{req.method} {req.path}")
        c.pause_sandbox(sandbox_id)
        return api.Response(204)

    def resume(self, c: Controller, req: api.Request) -> api.Response:
        sandbox_id = _id(req)
        body = _body(req, RESUME, f"{req.method} {req.path}")
        info = c.resume_sandbox(sandbox_id, body["timeout"] or None)
        return api.Response(201, self._sandbox(c, info, req))

    def fork(self, c: Controller, req: api.Request) -> api.Response:
        """E2B's fork: BRANCH the running sandbox (it pauses briefly and goes on, same id)
        into a snapshot named by the daemon, then spawn ``count`` sandboxes from it. The
        snapshot stays, as a template (``templateID`` of the forks) that can be deleted
        once they are gone; each fork's result is one entry, as E2B answers."""
        sandbox_id = _id(req)
        where = f"{req.method} {req.path}"
        body = _body(req, FORK, where)
        _, snapshot = c.branch_sandbox(sandbox_id, Branch())
        spawn: dict[str, Any] = {"snapshot_tag": snapshot["tag"], "n": body["count"]}
        if body["timeout"]:
            spawn["timeout_secs"] = body["timeout"]
        req.snapshot_tag = snapshot["tag"]
        infos = c.create_sandboxes(SandboxCreate.of(validate_fields(spawn, api.SANDBOX_CREATE,
                                                                    where)))
        req.sandbox_ids = [sandbox_id, *(i["id"] for i in infos)]
        return api.Response(201, [{"sandbox": self._sandbox(c, i, req)} for i in infos])

    def create_snapshot(self, c: Controller, req: api.Request) -> api.Response:
        """E2B's named snapshot (``create_snapshot``): a BRANCH of the running sandbox
        (it pauses briefly and goes on) into the tag ``name``, or one the daemon names.
        ``snapshotID`` is the tag, which ``Sandbox.create(template=…)`` spawns from."""
        sandbox_id = _id(req)
        where = f"{req.method} {req.path}"
        body = _body(req, SNAPSHOT, where)
        if body["memory"] is False:
            # A snapshot here is always the whole machine; one whose sandboxes cold-boot
            # would be another thing, so it is refused rather than silently given.
            raise BadRequest(f"{where}: filesystem-only snapshots (memory: false) are not "
                             "served; a snapshot here keeps memory and filesystem")
        _, snapshot = c.branch_sandbox(sandbox_id, Branch(tag=body["name"]))
        req.snapshot_tag = snapshot["tag"]
        return api.Response(201, _snapshot_info(snapshot["tag"]))

    def list_snapshots(self, c: Controller, req: api.Request) -> api.Response:
        """E2B's ``list_snapshots``: the snapshots BRANCHed from sandboxes (E2B's
        snapshots are made from sandboxes; base templates are not listed), ready ones,
        oldest first, filtered by ``sandboxID`` and ``name``, paged by ``x-next-token``.
        A pause's own snapshots are the sandbox's, not listed."""
        where = f"{req.method} {req.path}"
        q = parse_query(req.query, {
            "sandboxID": Field(str, None, nullable=True),
            "name": Field(str, None, nullable=True),
            "limit": Field(int, None, between(1, MAX_LIST_LIMIT), nullable=True),
            "nextToken": Field(str, None, nullable=True)}, where)
        listed = sorted((s for s in c.list_snapshots()
                         if s.get("status") == "ready" and s.get("branched_from")
                         and not str(s["tag"]).startswith(PAUSE_TAG_PREFIX)
                         and q["sandboxID"] in (None, s["branched_from"])
                         and q["name"] in (None, s["tag"])),
                        key=lambda s: (s["created_at_unix"], s["tag"]))
        page, headers = _page(listed, q, where)
        return api.Response(200, [_snapshot_info(s["tag"]) for s in page], headers=headers)

    def delete_template(self, c: Controller, req: api.Request) -> api.Response:
        """E2B's ``delete_snapshot`` (and template deletion): delete the snapshot tag.
        One that sandboxes or other snapshots still depend on is vmfork's 409; an
        unknown one 404 (the SDK's ``False``)."""
        tag = req.params["id"]
        problem = check_tag(tag)
        if problem:
            raise BadRequest(f"{req.method} {req.path}: the template {problem}")
        req.snapshot_tag = tag
        c.delete_snapshot(tag, False, False)
        return api.Response(204)

    def metrics(self, c: Controller, req: api.Request) -> api.Response:
        """E2B's metrics series: the host's samples of the sandbox (every
        ``SAMPLE_INTERVAL_S``, the last ten minutes) within ``start``..``end`` (unix
        seconds), then one taken now with the guest's disk; CPU % is over the interval
        before each (the first of the series has none: 0)."""
        sandbox_id = _id(req)
        q = parse_query(req.query, {
            "start": Field(int, None, between(0, 1 << 40), nullable=True),
            "end": Field(int, None, between(0, 1 << 40), nullable=True)},
            f"{req.method} {req.path}")
        samples = c.sandbox_metric_samples(sandbox_id)
        now = c.sandbox_metrics(sandbox_id)
        vcpus = samples[0]["vcpus"] if samples else 1
        now["cpu_used_pct"] = cpu_used_pct(samples[-1] if samples else None, now, vcpus)
        series = [*samples, {**now, "vcpus": vcpus}]
        start, end = q["start"], q["end"]
        series = [s for s in series if (start is None or s["timestamp_unix"] >= start)
                  and (end is None or s["timestamp_unix"] <= end + 1)]
        mem_total = int(now.get("guest_mem_mib") or 0) << 20
        return api.Response(200, [{
            "timestamp": _iso(m["timestamp_unix"]), "timestampUnix": int(m["timestamp_unix"]),
            "cpuCount": int(m["vcpus"]),
            "cpuUsedPct": float(m.get("cpu_used_pct") or 0.0),
            "memUsed": int(m.get("memory_cgroup_bytes") or 0),
            "memTotal": mem_total,
            "memCache": 0,
            # The disk is asked of the guest only now; samples carry the latest known.
            "diskUsed": int(now.get("disk_used_bytes") or 0),
            "diskTotal": int(now.get("disk_total_bytes") or 0)} for m in series])


def _snapshot_info(tag: str) -> dict[str, Any]:
    """E2B's ``SnapshotInfo``: the id is the tag, and its one name."""
    return {"snapshotID": tag, "names": [tag]}


def _page(listed: list[dict[str, Any]], q: dict[str, Any],
          where: str) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """E2B's paging: ``limit`` entries from the offset ``nextToken`` (a token this
    server gave), and the next one's token in ``x-next-token`` while more are left."""
    start = 0
    if q["nextToken"]:
        if not q["nextToken"].isdigit():
            raise BadRequest(f"{where}: nextToken is not one this server gave")
        start = int(q["nextToken"])
    limit = q["limit"] or MAX_LIST_LIMIT
    headers = {}
    if start + limit < len(listed):
        headers["x-next-token"] = str(start + limit)
    return listed[start:start + limit], headers


def _id(req: api.Request) -> str:
    sandbox_id = req.params["id"]
    req.sandbox_ids = [sandbox_id]
    return sandbox_id


def _metadata_query(raw: str | None, where: str) -> dict[str, str]:
    """E2B's ``metadata`` filter: ``k=v&k2=v2``, each key and value percent-encoded,
    the whole percent-encoded again as one query value."""
    import urllib.parse
    if not raw:
        return {}
    pairs = urllib.parse.parse_qsl(raw, keep_blank_values=True, max_num_fields=MAX_METADATA)
    return {urllib.parse.unquote(k): urllib.parse.unquote(v) for k, v in pairs}


def _iso(unix: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(unix))
