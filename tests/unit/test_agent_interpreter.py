"""The agent's code interpreter (``cell``/``contexts`` ops) on a real agent server:
values, rich results, contexts, interrupting, bounds."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.unit.agent_support import running_agent
from vmfork.agent.client import AgentClient, AgentError
from vmfork.agent.interpreter import MAX_CELL_RESULT_BYTES, MAX_CODE_CHARS, MAX_RESULTS


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


def test_display_sends_results_in_order_within_bounds() -> None:
    with running_agent() as agent:
        c = agent.client
        events, end = _run(c, "class H:\n    def __repr__(self): return 'H()'\n"
                              "    def _repr_html_(self): return '<p>h</p>'\n"
                              "print('before')\ndisplay(1, H())\nprint('after')\n"
                              "display('two')\n'last'")
        assert end["error"] is None
        assert [kind for kind, _ in events] == ["stdout", "result", "result", "stdout",
                                                "result", "result"]
        results = [data for kind, data in events if kind == "result"]
        assert results == [{"text": "1", "is_main_result": False},
                           {"text": "H()", "html": "<p>h</p>", "is_main_result": False},
                           {"text": "'two'", "is_main_result": False},
                           {"text": "'last'", "is_main_result": True}]
        assert events[0][1][0] == "before\n" and events[3][1][0] == "after\n"
        # Another context's cells (a restarted one's too) see the builtin; a cell's own
        # ``display`` wins; an option IPython has and this does not is a TypeError.
        made = c.code_contexts("create")["context"]["id"]
        c.code_contexts("restart", context=made)
        events, _ = _run(c, "display([1])", context=made)
        assert events == [("result", {"text": "[1]", "is_main_result": False})]
        events, _ = _run(c, "display = lambda x: print('own', x)\ndisplay(2)", context=made)
        assert events[0][0] == "stdout" and events[0][1][0] == "own 2\n"
        _, end = _run(c, "display(1, display_id='x')")
        assert end["error"]["name"] == "TypeError" and "display_id" in end["error"]["value"]
        # A thread of the cell's that displays after the cell is over prints instead.
        _, end = _run(c, "import threading, time\n"
                         "t = threading.Thread(target=lambda: (time.sleep(0.3), display(7)))\n"
                         "t.start()")
        time.sleep(0.8)
        events, _ = _run(c, "t.join()\n'joined'")
        assert events == [("result", {"text": "'joined'", "is_main_result": True})]
        # Bounds: displays stop at MAX_RESULTS - 1, the trailing value still comes, and
        # the drop is said once on stderr; a cell's results are bounded in bytes too.
        events, end = _run(c, f"for i in range({MAX_RESULTS + 5}): display(i)\n'main'")
        results = [data for kind, data in events if kind == "result"]
        assert len(results) == MAX_RESULTS and results[-1] == {"text": "'main'",
                                                               "is_main_result": True}
        assert [r["text"] for r in results[:-1]] == [str(i) for i in range(MAX_RESULTS - 1)]
        stderr = "".join(data[0] for kind, data in events if kind == "stderr")
        assert stderr.count("the rest were dropped") == 1
        big = MAX_CELL_RESULT_BYTES // 6
        events, end = _run(c, "class Big:\n    def __repr__(self): return 'Big'\n"
                              f"    def _repr_html_(self): return 'x' * {big}\n"
                              "for _ in range(10): display(Big())\n'main'", timeout=60)
        results = [data for kind, data in events if kind == "result"]
        assert len(results) == 11 and results[-1]["text"] == "'main'"
        full = [r for r in results if "html" in r]
        assert 4 <= len(full) <= 5, len(full)      # then text only, the reason said
        assert all(r["extra"]["vmfork_dropped"] == ["html"] for r in results[len(full):-1])
        assert sum(len(r.get("html", "")) for r in results) <= MAX_CELL_RESULT_BYTES


def test_streamed_output_goes_in_whole_lines() -> None:
    """The periodic flush does not split a line written in pieces (``print`` writes
    the text and the newline apart); a line that does not end still goes, later."""
    with running_agent() as agent:
        c = agent.client
        events, _ = _run(c, "import sys, time\nsys.stdout.write('hel')\ntime.sleep(0.2)\n"
                            "sys.stdout.write('lo\\nnext')\ntime.sleep(0.2)\n"
                            "sys.stdout.write(' line\\n')")
        assert [data[0] for kind, data in events if kind == "stdout"] == [
            "hello\n", "next line\n"], events
        started = time.monotonic()
        events = c.cell("import sys, time\nsys.stdout.write('prompt> ')\ntime.sleep(3)",
                        timeout=30)
        shown = None
        for kind, data in events:
            if kind == "stdout":
                shown = (data[0], time.monotonic() - started)
                break
        events.close()
        assert shown is not None and shown[0] == "prompt> " and shown[1] < 2.5, shown
