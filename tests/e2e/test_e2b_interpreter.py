"""E2B's code interpreter against real guests: the unmodified ``e2b-code-interpreter``
(Python) and ``@e2b/code-interpreter`` (JavaScript) SDKs run ``run_code`` —
a value, an exception, streamed prints, contexts with separate globals, rich results,
an interrupted cell — in the warm interpreter of a real guest's agent, through
``vmfork serve`` pointed at by environment variables only. Plus the bad input a client
can send (an unknown context, too much code, an unknown sandbox)."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator

import pytest

from tests.e2b_sdk import (
    check_interpreter,
    e2b_env,
    interpreter_node_modules,
    interpreter_python,
    run_js_program,
    run_program,
)
from tests.mcp_support import RunningDaemon, tcp_daemon
from vmfork.agent.interpreter import MAX_CODE_CHARS

pytestmark = pytest.mark.e2e
TOKEN = "e2b-interpreter-e2e-token-0123456789"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningDaemon, int]]:
    with tcp_daemon(tmp_path_factory.mktemp("e2b-interpreter"), token=TOKEN,
                    snapshot="e2b-ci") as running:
        yield running


@pytest.mark.parametrize("sdk", ["python", "javascript"])
def test_run_code_in_real_guests(daemon: tuple[RunningDaemon, int], sdk: str) -> None:
    d, port = daemon
    env = e2b_env(f"http://127.0.0.1:{port}", TOKEN)
    started = time.monotonic()
    if sdk == "python":
        seen = run_program(interpreter_python(), "interpreter", ["e2b-ci"], env, timeout=900)
    else:
        seen = run_js_program("interpreter", ["e2b-ci"], env, timeout=900,
                              node_modules=interpreter_node_modules())
    elapsed = time.monotonic() - started
    check_interpreter(seen)
    assert d.controller.list_sandboxes() == []
    print(f"\nE2B code interpreter ({sdk} SDK) against a real guest: {elapsed:.1f} s; "
          f"the cell after an interrupted one answered in {seen['after_timeout_secs']:.2f} s")


def _request(port: int, method: str, path: str, body: dict | None,
             headers: dict[str, str]) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body).encode(),
                     headers={"Content-Type": "application/json", **headers})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def test_bad_input_against_a_real_guest(daemon: tuple[RunningDaemon, int]) -> None:
    _, port = daemon
    status, raw = _request(port, "POST", "/v2/sandboxes", {"templateID": "e2b-ci"},
                           {"X-API-KEY": TOKEN})
    assert status == 201, raw
    sb = json.loads(raw)
    key = {"E2b-Sandbox-Id": sb["sandboxID"], "E2b-Sandbox-Port": "49999",
           "X-Access-Token": sb["envdAccessToken"]}
    try:
        status, raw = _request(port, "POST", "/execute", {"code": "print('hi')\n1+1"}, key)
        lines = [json.loads(line) for line in raw.splitlines() if line.strip()]
        assert status == 200 and lines[0] == {**lines[0], "type": "stdout", "text": "hi\n"}
        assert lines[1] == {"type": "result", "text": "2", "is_main_result": True}
        for body, expected in (({"code": "1", "context_id": "nope"}, 404),
                               ({"code": "x" * (MAX_CODE_CHARS + 1)}, 413),
                               ({"code": "1", "language": "java"}, 400)):
            status, raw = _request(port, "POST", "/execute", body, key)
            assert status == expected, (body, raw[:300])
            assert json.loads(raw)["code"] == expected
        status, raw = _request(port, "POST", "/execute", {"code": "1"},
                               {**key, "E2b-Sandbox-Id": "sb-000000000000"})
        assert status == 401   # a token is per sandbox: an unknown one's cannot be shown
    finally:
        _request(port, "DELETE", f"/sandboxes/{sb['sandboxID']}", None, {"X-API-KEY": TOKEN})
