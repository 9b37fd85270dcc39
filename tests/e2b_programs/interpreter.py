"""An E2B code-interpreter program, unmodified ``e2b_code_interpreter`` SDK calls only:
where it runs is set by the environment (E2B_API_KEY, E2B_API_URL, E2B_SANDBOX_URL).
Run by the tests with the SDK's own interpreter (its venv, scripts/lib.sh
setup_e2b_sdk):

    python interpreter.py TEMPLATE

It prints one JSON object of what it saw; the tests assert on it (check_interpreter in
tests/e2b_sdk.py).
"""

import json
import sys
import time

from e2b import NotFoundException, TimeoutException
from e2b_code_interpreter import Sandbox


def main() -> None:
    seen: dict = {}
    sandbox = Sandbox.create(template=sys.argv[1])
    try:
        chunks: list[str] = []
        run = sandbox.run_code("x = 41\nprint('hello')\nimport sys\n"
                               "print('warn', file=sys.stderr)\nx + 1",
                               on_stdout=lambda m: chunks.append(m.line))
        seen["value"] = {"text": run.text, "stdout": run.logs.stdout,
                         "stderr": run.logs.stderr, "chunks": chunks,
                         "count": run.execution_count, "error": run.error is not None}
        seen["persists"] = sandbox.run_code("x * 2").text
        run = sandbox.run_code("def f():\n    raise ValueError('bad value')\nf()")
        seen["error"] = {"name": run.error.name, "value": run.error.value,
                         "traceback": run.error.traceback, "text": run.text}

        stamps: list[float] = []
        sandbox.run_code("import time\nprint('first', flush=True)\ntime.sleep(1.5)\n"
                         "print('second')", on_stdout=lambda m: stamps.append(time.monotonic()))
        seen["streamed_gap"] = stamps[1] - stamps[0] if len(stamps) == 2 else None

        context = sandbox.create_code_context(cwd="/tmp")
        seen["context_cwd"] = context.cwd
        seen["context_sees_x"] = sandbox.run_code("x", context=context).error.name
        sandbox.run_code("y = 'mine'", context=context)
        seen["context_y"] = sandbox.run_code("y", context=context).text
        seen["default_sees_y"] = sandbox.run_code("y").error.name
        seen["context_getcwd"] = sandbox.run_code("import os\nos.getcwd()", context=context).text
        seen["listed"] = context.id in [c.id for c in sandbox.list_code_contexts()]
        sandbox.restart_code_context(context)
        seen["after_restart"] = sandbox.run_code("y", context=context).error.name
        sandbox.remove_code_context(context)
        try:
            sandbox.run_code("1", context=context)
            seen["removed_context"] = None
        except NotFoundException as err:
            seen["removed_context"] = str(err)

        seen["env"] = sandbox.run_code("import os\nos.environ['CI_VAR']",
                                       envs={"CI_VAR": "from-envs"}).text
        rich = sandbox.run_code("class Rich:\n    def __repr__(self): return 'Rich()'\n"
                                "    def _repr_html_(self): return '<b>rich</b>'\n"
                                "    def _repr_png_(self): return b'\\x89PNG-bytes'\nRich()")
        seen["rich"] = {"text": rich.results[0].text, "html": rich.results[0].html,
                        "png": rich.results[0].png, "formats": sorted(rich.results[0].formats())}
        shown = sandbox.run_code("print('before')\ndisplay(1)\ndisplay(Rich(), 'two')\n"
                                 "'end'")
        seen["displayed"] = {"results": [{"text": r.text, "html": r.html,
                                          "main": r.is_main_result} for r in shown.results],
                             "text": shown.text, "stdout": shown.logs.stdout,
                             "error": shown.error and (shown.error.name, shown.error.value)}
        try:
            sandbox.run_code("while True: pass", timeout=2)
            seen["timed_out"] = None
        except TimeoutException as err:
            seen["timed_out"] = str(err)
        started = time.monotonic()
        seen["after_timeout"] = sandbox.run_code("'alive'").text
        seen["after_timeout_secs"] = time.monotonic() - started
        has_mpl = sandbox.run_code("import importlib.util\n"
                                   "importlib.util.find_spec('matplotlib') is not None").text
        if has_mpl == "True":
            plot = sandbox.run_code("import matplotlib\nmatplotlib.use('Agg')\n"
                                    "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\n"
                                    "print('plotted')")
            seen["plot_png"] = [r.png[:12] for r in plot.results if r.png]
    finally:
        sandbox.kill()
    print(json.dumps(seen))


main()
