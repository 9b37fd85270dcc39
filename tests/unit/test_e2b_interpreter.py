"""E2B's code interpreter on the daemon: the real ``e2b-code-interpreter`` SDK (Python,
its own venv) and ``@e2b/code-interpreter`` (JavaScript) run ``run_code`` against a
real daemon on TCP whose sandboxes have a real agent server behind them (the agent's
``cell`` op runs the code in this process's Python; tests/e2e/test_e2b_interpreter.py
runs the same programs against real guests). Plus its edges with raw HTTP: tokens,
routing by Host, bad requests."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2b_sdk import (
    check_interpreter,
    e2b_env,
    interpreter_node_modules,
    interpreter_python,
    run_js_program,
    run_program,
)
from tests.unit.test_e2b_wire import Daemon, _create, _daemon, _request
from tests.unit.test_server_http import TOKEN
from vmfork.agent.interpreter import MAX_CODE_CHARS, MAX_CONTEXTS
from vmfork.server.e2b import _wire


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    yield from _daemon(tmp_path)


@pytest.mark.parametrize("sdk", ["python", "javascript"])
def test_run_code_with_the_e2b_interpreter_sdk(daemon: Daemon, sdk: str) -> None:
    env = e2b_env(daemon.url, TOKEN.decode())
    if sdk == "python":
        seen = run_program(interpreter_python(), "interpreter", ["base"], env)
    else:
        seen = run_js_program("interpreter", ["base"], env,
                              node_modules=interpreter_node_modules())
    check_interpreter(seen)
    assert daemon.ctl.list_sandboxes() == []


def _headers(sandbox: dict, **extra: str) -> dict[str, str]:
    return {"E2b-Sandbox-Id": sandbox["sandboxID"], "E2b-Sandbox-Port": "49999",
            "X-Access-Token": sandbox["envdAccessToken"],
            "Content-Type": "application/json", **extra}


def _execute(d: Daemon, sandbox: dict, body: dict, **headers: str) -> tuple[int, bytes]:
    status, _, raw = _request(d, "POST", "/execute", json.dumps(body).encode(),
                              _headers(sandbox, **headers))
    return status, raw


def _lines(raw: bytes) -> list[dict]:
    return [json.loads(line) for line in raw.splitlines() if line.strip()]


def test_execute_streams_ndjson(daemon: Daemon) -> None:
    sb = _create(daemon)
    assert sb["trafficAccessToken"] == sb["envdAccessToken"]
    status, raw = _execute(daemon, sb, {"code": "print('out')\n1+1", "context_id": None,
                                        "language": None, "env_vars": None})
    assert status == 200, raw
    lines = _lines(raw)
    assert [line["type"] for line in lines] == ["stdout", "result", "number_of_executions",
                                               "end_of_execution"]
    assert lines[0]["text"] == "out\n" and abs(lines[0]["timestamp"] / 1e9 - time.time()) < 60
    assert lines[1] == {"type": "result", "text": "2", "is_main_result": True}
    status, raw = _execute(daemon, sb, {"code": "1/0"})
    error = _lines(raw)[0]
    assert error["type"] == "error" and error["name"] == "ZeroDivisionError"
    assert error["value"] == "division by zero" and "1/0" in error["traceback"]
    # Syntax errors are the cell's, too.
    status, raw = _execute(daemon, sb, {"code": "def ("})
    assert status == 200 and _lines(raw)[0]["name"] == "SyntaxError"


def test_routing_and_tokens(daemon: Daemon) -> None:
    one, two = _create(daemon), _create(daemon)
    # By Host, as behind a TLS proxy for E2B_DOMAIN: 49999-<id>.<domain>.
    status, _, raw = _request(daemon, "GET", "/contexts", headers={
        "Host": f"49999-{one['sandboxID']}.e2b.example",
        "E2B-Traffic-Access-Token": one["envdAccessToken"]})
    assert status == 200 and [c["id"] for c in json.loads(raw)] == ["default"], raw
    # Another sandbox's token, or none, opens nothing.
    for token_headers in ({"X-Access-Token": two["envdAccessToken"]},
                          {"E2B-Traffic-Access-Token": "nope"}, {}):
        status, _, raw = _request(daemon, "GET", "/contexts", headers={
            "E2b-Sandbox-Id": one["sandboxID"], "E2b-Sandbox-Port": "49999",
            **token_headers})
        assert status == 401 and json.loads(raw)["code"] == 401, raw
    # Separate sandboxes, separate interpreters... here one agent serves both (no VM),
    # so only the token separation is shown; tests/e2e shows separate guests.
    status, raw = _execute(daemon, one, {"code": "1"}, **{
        "E2b-Sandbox-Id": "sb-unknown", "X-Access-Token": "x"})
    assert status == 401
    status, raw = _execute(daemon, one, {"code": "1"}, **{"E2b-Sandbox-Id": "../x"})
    assert status == 400, raw


def test_bad_input_gets_a_clear_4xx(daemon: Daemon) -> None:
    sb = _create(daemon)
    cases = [
        ({"code": "1", "context_id": "no-such-context"}, 404, "no code context"),
        ({"code": "x" * (MAX_CODE_CHARS + 1)}, 413, "characters"),
        ({"code": "1", "language": "r"}, 400, "Python only"),
        ({"code": 5}, 400, "'code'"),
        ({"code": "1", "bogus": True}, 400, "unknown field"),
        ({"code": "1", "env_vars": {"A": 1}}, 400, "env_vars"),
        ({"code": "1", "env_vars": {"A=B": "c"}}, 400, "environment variable"),
        ({}, 400, "'code'"),
    ]
    for body, status, words in cases:
        got, raw = _execute(daemon, sb, body)
        assert got == status, (body, raw[:300])
        assert words in json.loads(raw)["message"], (body, raw[:300])
    status, _, raw = _request(daemon, "POST", "/execute", b"not json", _headers(sb))
    assert status == 400
    status, _, raw = _request(daemon, "POST", "/contexts",
                              json.dumps({"cwd": "/definitely/not/here"}).encode(),
                              _headers(sb))
    assert status == 400 and "directory" in json.loads(raw)["message"], raw
    status, _, raw = _request(daemon, "DELETE", "/contexts/default", headers=_headers(sb))
    assert status == 400 and "default context" in json.loads(raw)["message"]
    status, _, raw = _request(daemon, "POST", "/contexts/nope/restart", headers=_headers(sb))
    assert status == 404
    status, headers, _ = _request(daemon, "PUT", "/execute", b"{}", _headers(sb))
    assert status == 405 and headers["allow"] == "POST"
    assert _request(daemon, "GET", "/nowhere", headers=_headers(sb))[0] == 404
    # An unknown sandbox (with a token that would be its own): 404.
    fake = {"sandboxID": "sb-0123456789ab",
            "envdAccessToken": _wire(TOKEN).tokens.for_sandbox("sb-0123456789ab")}
    status, raw = _execute(daemon, fake, {"code": "1"})
    assert status == 404 and json.loads(raw)["code"] == 404, raw


def test_contexts_are_bounded(daemon: Daemon) -> None:
    sb = _create(daemon)
    made = []
    for _ in range(MAX_CONTEXTS):
        status, _, raw = _request(daemon, "POST", "/contexts", b"{}", _headers(sb))
        assert status == 200, raw
        made.append(json.loads(raw)["id"])
    status, _, raw = _request(daemon, "POST", "/contexts", b"{}", _headers(sb))
    assert status == 429 and "at most" in json.loads(raw)["message"], raw
    for context_id in made:
        status, _, _ = _request(daemon, "DELETE", f"/contexts/{context_id}",
                                headers=_headers(sb))
        assert status == 204
    status, _, raw = _request(daemon, "GET", "/contexts", headers=_headers(sb))
    assert [c["id"] for c in json.loads(raw)] == ["default"]


def test_a_cells_output_is_bounded(daemon: Daemon) -> None:
    sb = _create(daemon)
    status, raw = _execute(daemon, sb, {"code": "import sys\nfor _ in range(200):\n"
                                        "    sys.stdout.write('x' * (64 << 10))\n'done'"})
    assert status == 200
    lines = _lines(raw)
    out = sum(len(line["text"]) for line in lines if line["type"] == "stdout")
    assert out == 8 << 20
    assert any("output passed" in line["text"] for line in lines if line["type"] == "stderr")
    assert [line["text"] for line in lines if line["type"] == "result"] == ["'done'"]


def test_the_default_context_is_the_eval_namespace(daemon: Daemon) -> None:
    """What a snapshot's warm-up (or vmfork's own ``eval``) defined is in run_code's
    default context, and the other way round."""
    sb = _create(daemon)
    _execute(daemon, sb, {"code": "shared = 7"})
    status, _, raw = _request(daemon, "POST", f"/v1/sandboxes/{sb['sandboxID']}/eval",
                              json.dumps({"code": "shared * 6"}).encode(),
                              {"Authorization": f"Bearer {TOKEN.decode()}",
                               "Content-Type": "application/json"})
    assert status == 200 and json.loads(raw)["result"] == "42", raw
