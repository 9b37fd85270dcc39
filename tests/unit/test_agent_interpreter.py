"""The agent's code interpreter (``cell``/``contexts`` ops) on a real agent server:
values, rich results, contexts, interrupting, bounds."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.unit.agent_support import running_agent
from vmfork.agent.client import AgentClient, AgentError
from vmfork.agent.interpreter import MAX_CODE_CHARS


def _run(client: AgentClient, code: str, timeout: float = 30,
         **kw: Any) -> tuple[list, dict]:
    events = list(client.cell(code, timeout=timeout, **kw))
    assert events[0][0] == "started" and events[-1][0] == "end"
    return events[1:-1], events[-1][1]


def test_values_results_and_errors() -> None:
    with running_agent() as agent:
        c = agent.client
        events, end = _run(c, "class R:\n    def _repr_html_(self): return '<i>r</i>'\n"
                              "    def _repr_json_(self): return {'a': 1}\n"
                              "    def _repr_png_(self): return (b'png', {})\n"
                              "    def _repr_latex_(self): raise ValueError\nR()")
        [(kind, bundle)] = events
        assert kind == "result" and bundle["html"] == "<i>r</i>" and bundle["json"] == {"a": 1}
        assert bundle["png"] == "cG5n" and "latex" not in bundle and bundle["is_main_result"]
        assert end["error"] is None and end["execution_count"] == 1
        events, end = _run(c, "R")   # a class: its repr only
        assert events == [("result", {"text": events[0][1]["text"], "is_main_result": True})]
        events, end = _run(c, "raise SystemExit(3)")
        assert events == [] and end["error"]["name"] == "SystemExit"
        events, end = _run(c, "x = 1")   # no trailing expression: no result
        assert events == [] and end["error"] is None


def test_a_cell_past_its_timeout_is_interrupted_and_the_next_runs() -> None:
    with running_agent() as agent:
        c = agent.client
        started = time.monotonic()
        _, end = _run(c, "n = 0\nwhile True: n += 1", timeout=1)
        assert end["error"]["name"] == "CellTimeout" and time.monotonic() - started < 10
        _, end = _run(c, "n > 0")
        assert end["error"] is None
        # A client that hangs up interrupts its cell too.
        events = c.cell("while True: pass", timeout=60)
        next(events)
        events.close()
        started = time.monotonic()
        results, end = _run(c, "'next'")
        assert results[0][1]["text"] == "'next'" and time.monotonic() - started < 10


def test_contexts_and_bounds() -> None:
    with running_agent() as agent:
        c = agent.client
        made = c.code_contexts("create", cwd="/tmp")["context"]
        _run(c, "import os\nhere = os.getcwd()\nos.environ.get('CV')", context=made["id"],
             env={"CV": "1"})
        results, _ = _run(c, "here, os.environ.get('CV')", context=made["id"])
        assert results[0][1]["text"] == "('/tmp', None)"   # env restored after the cell
        with pytest.raises(AgentError) as err:
            list(c.cell("1", context="nope", timeout=5))
        assert err.value.code == "not_found"
        with pytest.raises(AgentError) as err:
            list(c.cell("x" * (MAX_CODE_CHARS + 1), timeout=5))
        assert err.value.code == "too_large"
        with pytest.raises(AgentError) as err:
            c.code_contexts("remove", context="default")
        assert err.value.code == "bad_request"
        with pytest.raises(AgentError) as err:
            c.code_contexts("explode")
        assert err.value.code == "bad_request"
        assert c.code_contexts("remove", context=made["id"])["removed"] == made["id"]
