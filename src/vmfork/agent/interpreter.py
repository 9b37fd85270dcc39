"""The ``cell`` and ``contexts`` ops: a code interpreter in the agent's warm Python
(stdlib only), what E2B's code interpreter (``run_code``) is served by.

A *context* is a globals dict. The ``default`` one is the ``eval`` op's namespace (see
``evaluator.py``), so whatever a snapshot's warm-up imported is there; others are made
with ``contexts`` (``create``), each a module of its own registered in ``sys.modules``
(so what a cell defines pickles), at most ``MAX_CONTEXTS``. A cell is a Jupyter cell:
its statements run, and the value of a trailing expression is its main result, as a
bundle of representations — ``text`` (the ``repr``) and whatever the object's
``_repr_*_`` methods give (``html`` from a pandas DataFrame, ``png``, ``svg``, ``latex``,
``json``…); nothing is imported for this. Figures left open in ``matplotlib.pyplot``
(if the code imported it) become PNG results and are closed, as a notebook shows them.
``display(obj, …)`` (IPython's builtin, installed as a builtin here too) sends a result
at that point of the cell, by the same rules, so a cell gives several results in order;
the trailing value, sent last but for open figures, is the one marked main.

Cells run one at a time (a kernel's rule): a cell changes process-wide state — the
working directory (its context's ``cwd``) and the environment (the request's ``env``,
restored afterwards) — so two cannot overlap. A cell waiting for another gives up at
its own deadline.

Streaming and bounds. stdout/stderr go out as ``stdout``/``stderr`` frames (stamped
with the wall clock, in nanoseconds) every ``FLUSH_INTERVAL`` while the cell runs, in
whole lines (a line not ended goes after ``PARTIAL_LINE_HOLD``);
past ``MAX_CELL_OUTPUT`` bytes a cell's output is dropped (said once on stderr and in
the result). Results go as ``display`` frames (a JSON bundle, split into payloads of
``MAX_PAYLOAD``), each at most ``MAX_RESULT_BYTES`` (a larger representation is left
out, the ``text`` kept), at most ``MAX_RESULTS`` and ``MAX_CELL_RESULT_BYTES`` a cell
(the last slot is kept for the trailing value; past the bounds ``display`` results are
dropped, said once on stderr). A cell's code is at most ``MAX_CODE_CHARS``.

Interrupting. A cell that passes its ``timeout``, or whose host hangs up (the client
went away: E2B's SDK closes its connection when its own timeout passes), gets an
exception raised in its thread (``PyThreadState_SetAsyncExc``): ``CellTimeout`` or
``KeyboardInterrupt``, reported as the cell's error. That lands at the next bytecode, so
a cell blocked inside one C call (a long ``time.sleep``) ends only when the call
returns; it still cannot hold the agent: its connection thread is its own.
"""

from __future__ import annotations

import ast
import base64
import builtins
import ctypes
import io
import json
import linecache
import os
import select
import socket
import sys
import threading
import time
import types
import uuid
from dataclasses import dataclass
from typing import Any

from vmfork.agent.conn import Conn, PeerGone
from vmfork.agent.evaluator import Evaluator, _routed, traceback_text
from vmfork.agent.protocol import MAX_PAYLOAD, OUTPUT_CHUNK
from vmfork.agent.request import OpError, get_str

DEFAULT_CONTEXT = "default"
DEFAULT_CWD = "/root"
MAX_CONTEXTS = 32
"""Contexts made with ``create`` (the default one is not counted)."""
MAX_CODE_CHARS = 128 << 10
"""A cell's source: at most this many characters (it travels in one frame header)."""
MAX_CELL_OUTPUT = 8 << 20
"""stdout + stderr bytes one cell may send."""
MAX_RESULT_BYTES = 8 << 20
MAX_RESULTS = 32
"""Results of one cell: ``display`` calls, the trailing value, open figures."""
MAX_CELL_RESULT_BYTES = 32 << 20
"""Result bytes (their JSON) one cell may send, all its results together."""
MAX_TIMEOUT = 3600.0
MAX_ENV = 256
MAX_ENV_BYTES = 64 << 10
MAX_TEXT_CHARS = 1 << 20
"""A result's ``text`` (its ``repr``) is cut to this many characters."""
FLUSH_INTERVAL = 0.05
PARTIAL_LINE_HOLD = 0.5
"""How long the periodic flush holds a line that has not ended (``print(x, end='')``
shows within this)."""
_REPRS = (("_repr_html_", "html"), ("_repr_markdown_", "markdown"), ("_repr_svg_", "svg"),
          ("_repr_png_", "png"), ("_repr_jpeg_", "jpeg"), ("_repr_pdf_", "pdf"),
          ("_repr_latex_", "latex"), ("_repr_json_", "json"),
          ("_repr_javascript_", "javascript"))
_BINARY = ("png", "jpeg", "pdf")
"""Representations that are bytes: sent base64-encoded, as Jupyter does."""


class CellTimeout(TimeoutError):
    """Raised in a cell that ran past its timeout."""


@dataclass
class _Context:
    id: str
    cwd: str
    namespace: dict[str, Any]
    module: str | None      # its sys.modules name (None: the eval op's, not ours)
    executions: int = 0

    def describe(self) -> dict[str, str]:
        return {"id": self.id, "language": "python", "cwd": self.cwd}


def _module_namespace(name: str) -> dict[str, Any]:
    module = types.ModuleType(name, "A code-interpreter context of the vmfork agent.")
    module.__dict__["__builtins__"] = builtins
    sys.modules[name] = module
    return module.__dict__


class _Sink:
    """One cell's stdout or stderr: buffered, sent by the cell's watchdog every
    ``FLUSH_INTERVAL`` and at the end, within the cell's output budget."""

    def __init__(self, conn: Conn, kind: str, budget: list[int]) -> None:
        self.conn = conn
        self.kind = kind
        self.budget = budget         # shared by stdout and stderr: bytes left
        self.buffer = bytearray()
        self.lock = threading.Lock()
        self.broken = False
        self.truncated = False
        self.partial_since: float | None = None   # when the held line's start came

    def write(self, text: str) -> None:
        data = text.encode("utf-8", "surrogateescape")
        with self.lock:
            room = self.budget[0]
            if len(data) > room:
                data = data[:room]
                self.truncated = True
            self.budget[0] -= len(data)
            self.buffer += data
            full = len(self.buffer) >= OUTPUT_CHUNK
        if full:
            self.flush()

    def flush(self, whole: bool = True) -> None:
        """Send what is buffered. The watchdog's periodic flush (``whole`` false) sends
        whole lines only, holding a line's start for at most ``PARTIAL_LINE_HOLD``:
        ``print`` writes a line and its newline separately, and a flush between the
        two would split the line into two messages (E2B's SDKs keep each as one entry
        of ``logs.stdout``)."""
        with self.lock:
            cut = len(self.buffer)
            if not whole and cut < OUTPUT_CHUNK:
                newline = self.buffer.rfind(b"\n") + 1
                now = time.monotonic()
                if newline < cut:      # a line begun and not ended
                    if self.partial_since is None:
                        self.partial_since = now
                    if now - self.partial_since < PARTIAL_LINE_HOLD:
                        cut = newline
            data, self.buffer = bytes(self.buffer[:cut]), self.buffer[cut:]
            if not self.buffer:
                self.partial_since = None
            elif cut:
                self.partial_since = time.monotonic()
        for start in range(0, len(data), OUTPUT_CHUNK):
            if self.broken:
                return
            try:
                self.conn.send({"type": self.kind, "ts": time.time_ns()},
                               data[start:start + OUTPUT_CHUNK])
            except PeerGone:
                self.broken = True   # the host left; the watchdog interrupts the cell


class _Watchdog(threading.Thread):
    """Flushes a running cell's output and interrupts it when it passes its deadline or
    its host hangs up (the host sends nothing after the request, so readable = EOF)."""

    def __init__(self, conn: Conn, sinks: tuple[_Sink, _Sink], deadline: float,
                 target: int) -> None:
        super().__init__(name="agent-cell-watchdog", daemon=True)
        self.conn, self.sinks, self.deadline, self.target = conn, sinks, deadline, target
        self.lock = threading.Lock()
        self.running = True          # cleared, under ``lock``, once the cell is done
        self.raised: type[BaseException] | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(FLUSH_INTERVAL):
            for sink in self.sinks:
                sink.flush(whole=False)
            if self.raised is not None:
                continue
            if time.monotonic() >= self.deadline:
                self._interrupt(CellTimeout)
            elif self._host_gone():
                self._interrupt(KeyboardInterrupt)

    def _host_gone(self) -> bool:
        if any(sink.broken for sink in self.sinks):
            return True
        try:
            readable, _, _ = select.select([self.conn.sock], [], [], 0)
            return bool(readable) and not self.conn.sock.recv(1, socket.MSG_PEEK)
        except (OSError, ValueError):
            return True

    def _interrupt(self, kind: type[BaseException]) -> None:
        with self.lock:
            if self.running:
                self.raised = kind
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.target),
                                                           ctypes.py_object(kind))

    def finish(self) -> None:
        """The cell is over: no interrupt from now on, and one sent too late to land
        is withdrawn (it would otherwise go off in the agent's own code)."""
        with self.lock:
            self.running = False
            if self.raised is not None:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.target), None)
        self.stop.set()
        self.join()


class _Results:
    """One cell's results, sent as they come (``display`` calls, from any thread, while
    the cell runs; then the trailing value and open figures), within the cell's
    bounds."""

    def __init__(self, conn: Conn, sinks: tuple[_Sink, _Sink]) -> None:
        self.conn, self.sinks = conn, sinks
        self.lock = threading.Lock()    # a result's frames go together, in call order
        self.count = 0
        self.sent_bytes = 0
        self.dropped = 0
        self.figures: set[int] = set()  # ids of figures already sent (not sent twice)

    def send(self, value: Any, *, main: bool) -> None:
        self.send_bundle(_bundle(value, self.figures), main=main)

    def send_bundle(self, bundle: dict[str, Any], *, main: bool) -> None:
        for sink in self.sinks:
            sink.flush()    # output printed before the result goes before it
        with self.lock:
            # The last slot is the trailing value's: displays cannot crowd it out.
            if self.count >= MAX_RESULTS - (0 if main else 1):
                self._drop()
                return
            data = _result_json(bundle, main)
            if self.sent_bytes + len(data) > MAX_CELL_RESULT_BYTES:
                data = _text_only(bundle, main, f"the cell's results are over "
                                  f"{MAX_CELL_RESULT_BYTES} bytes")
                if self.sent_bytes + len(data) > MAX_CELL_RESULT_BYTES:
                    self._drop()
                    return
            self.count += 1
            self.sent_bytes += len(data)
            for start in range(0, len(data), MAX_PAYLOAD):
                self.conn.send({"type": "display", "more": start + MAX_PAYLOAD < len(data)},
                               data[start:start + MAX_PAYLOAD])

    def _drop(self) -> None:
        self.dropped += 1
        if self.dropped == 1:
            err = self.sinks[1]
            with err.lock:
                err.buffer += (f"\n[vmfork: this cell passed its {MAX_RESULTS} results or "
                               f"{MAX_CELL_RESULT_BYTES} bytes of results; the rest were "
                               "dropped]\n").encode()
            err.flush()


_current_lock = threading.Lock()
_current: _Results | None = None
"""The running cell's results (cells run one at a time), for ``display``."""


def display(*objs: Any, **kwargs: Any) -> None:
    """IPython's ``display``: each object becomes a result of the running cell, at this
    point of it (``text`` from its ``repr``, and its ``_repr_*_`` representations).
    Outside a cell (the agent's ``eval`` op), each object's ``repr`` is printed, as
    IPython does without a front end."""
    if kwargs:
        # IPython's other options (display_id, raw, include…) are not served: say so
        # rather than show something other than what was asked.
        raise TypeError(f"display(): vmfork's interpreter takes objects only, not "
                        f"{', '.join(sorted(kwargs))[:200]}")
    with _current_lock:
        results = _current
    for obj in objs:
        if results is None:
            print(repr(obj))
        else:
            results.send(obj, main=False)


class Interpreter:
    """The contexts and the ``cell`` and ``contexts`` ops."""

    def __init__(self, evaluator: Evaluator) -> None:
        # ``display`` is a builtin in IPython's kernels (E2B's is one): installed so, it
        # is found by every context's cells, a restarted one's too, unless one defines
        # its own.
        if not hasattr(builtins, "display"):
            builtins.display = display  # type: ignore[attr-defined]
        self._lock = threading.Lock()
        self._cell_lock = threading.Lock()
        self._default = _Context(DEFAULT_CONTEXT, DEFAULT_CWD, evaluator.namespace, None)
        self._contexts: dict[str, _Context] = {DEFAULT_CONTEXT: self._default}
        self._counter = 0

    # -- contexts ----------------------------------------------------------------------

    def contexts(self, conn: Conn, req: dict[str, Any]) -> None:
        action = get_str(req, "action")
        if action == "list":
            with self._lock:
                conn.result(contexts=[c.describe() for c in self._contexts.values()])
            return
        if action == "create":
            cwd = DEFAULT_CWD if req.get("cwd") is None else get_str(req, "cwd")
            if not os.path.isabs(cwd) or not os.path.isdir(cwd):
                raise OpError("bad_request", f"contexts: cwd {cwd[:200]!r} is not an "
                              "absolute path of a directory in the guest")
            with self._lock:
                if len(self._contexts) - 1 >= MAX_CONTEXTS:
                    raise OpError("limit", f"contexts: at most {MAX_CONTEXTS} contexts; "
                                  "remove one first")
                context_id = uuid.uuid4().hex
                module = f"vmfork_context_{context_id}"
                made = _Context(context_id, cwd, _module_namespace(module), module)
                self._contexts[context_id] = made
            conn.result(context=made.describe())
            return
        context = self._context(req)
        if action == "remove":
            if context is self._default:
                raise OpError("bad_request", "contexts: the default context cannot be "
                              "removed (restart it for fresh globals)")
            with self._lock:
                self._contexts.pop(context.id, None)
            if context.module is not None:
                sys.modules.pop(context.module, None)
            conn.result(removed=context.id)
        elif action == "restart":
            # Fresh globals in place: a cell running now keeps its old dict.
            keep = {"__builtins__": builtins, "__name__": context.namespace.get("__name__")}
            context.namespace.clear()
            context.namespace.update(keep)
            context.executions = 0
            conn.result(context=context.describe())
        else:
            raise OpError("bad_request", f"contexts: unknown action {action[:40]!r} "
                          "(list, create, remove, restart)")

    def _context(self, req: dict[str, Any]) -> _Context:
        raw = req.get("context")
        context_id = DEFAULT_CONTEXT if raw is None else get_str(req, "context")
        with self._lock:
            context = self._contexts.get(context_id)
        if context is None:
            raise OpError("not_found", f"no code context {context_id[:80]!r}")
        return context

    # -- cells -------------------------------------------------------------------------

    def cell(self, conn: Conn, req: dict[str, Any]) -> None:
        code = get_str(req, "code")
        if len(code) > MAX_CODE_CHARS:
            raise OpError("too_large", f"cell: the code is {len(code)} characters; at most "
                          f"{MAX_CODE_CHARS}")
        timeout = req.get("timeout", MAX_TIMEOUT)
        if (not isinstance(timeout, (int, float)) or isinstance(timeout, bool)
                or not 0 < timeout <= MAX_TIMEOUT):
            raise OpError("bad_request", f"cell: timeout must be 0-{MAX_TIMEOUT:g} seconds")
        env = _env(req.get("env"))
        context = self._context(req)
        deadline = time.monotonic() + timeout
        conn.send({"type": "started", "context": context.id})
        if not self._cell_lock.acquire(timeout=timeout):
            conn.result(execution_count=context.executions, output_truncated=False,
                        error=_error("CellTimeout", f"another cell ran for all of this "
                                     f"one's {timeout:g} s; this one did not start", ""))
            return
        try:
            self._run(conn, context, code, env, timeout, deadline)
        finally:
            self._cell_lock.release()

    def _run(self, conn: Conn, context: _Context, code: str, env: dict[str, str],
             timeout: float, deadline: float) -> None:
        global _current
        with self._lock:
            self._counter += 1
            filename = f"<cell-{self._counter}>"
        context.executions += 1
        budget = [MAX_CELL_OUTPUT]
        out, err = _Sink(conn, "stdout", budget), _Sink(conn, "stderr", budget)
        stdout, stderr = _routed("stdout"), _routed("stderr")
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        saved_env = {name: os.environ.get(name) for name in env}
        saved_cwd = _cwd()
        watchdog = _Watchdog(conn, (out, err), deadline, threading.get_ident())
        results = _Results(conn, (out, err))
        value: Any = None
        error: dict[str, str] | None = None
        stdout.local.sink, stderr.local.sink = out, err
        with _current_lock:
            _current = results
        try:
            os.environ.update(env)
            os.chdir(context.cwd)
            watchdog.start()
            try:
                try:
                    value = _execute(code, filename, context.namespace)
                finally:
                    watchdog.finish()
            except BaseException as exc:  # noqa: BLE001 - SystemExit must not end PID 1
                watchdog.finish()   # again: the interrupt may have landed in the first
                error = _exception(exc, filename, timeout)
        finally:
            if watchdog.is_alive():
                watchdog.finish()
            with _current_lock:
                _current = None     # a thread of the cell's displaying later: printed
            stdout.local.sink = stderr.local.sink = None
            linecache.cache.pop(filename, None)
            _restore(saved_env, saved_cwd)
        has_value = error is None and value is not None
        truncated = out.truncated or err.truncated
        if truncated:
            err.buffer += (f"\n[vmfork: this cell's output passed {MAX_CELL_OUTPUT} bytes; "
                           "the rest was dropped]\n").encode()
        out.flush()
        err.flush()
        if has_value:
            results.send(value, main=True)
        for bundle in _open_figures(results.figures):
            results.send_bundle(bundle, main=False)
        conn.result(execution_count=context.executions, error=error,
                    output_truncated=truncated)


def _execute(code: str, filename: str, namespace: dict[str, Any]) -> Any:
    """Run a cell; the value of its trailing expression (None without one)."""
    tree = ast.parse(code, filename, "exec")
    last: ast.Expression | None = None
    if tree.body and isinstance(trailing := tree.body[-1], ast.Expr):
        tree.body.pop()
        last = ast.Expression(trailing.value)
    exec(compile(tree, filename, "exec"), namespace)  # noqa: S102 - the op's purpose
    if last is None:
        return None
    return eval(compile(last, filename, "eval"), namespace)  # noqa: S307


def _env(raw: Any) -> dict[str, str]:
    if raw is None:
        return {}
    if (not isinstance(raw, dict) or len(raw) > MAX_ENV
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in raw.items())):
        raise OpError("bad_request", f"cell: env must map at most {MAX_ENV} names to strings")
    if sum(len(k) + len(v) for k, v in raw.items()) > MAX_ENV_BYTES:
        raise OpError("too_large", f"cell: env is over {MAX_ENV_BYTES} characters")
    for name, value in raw.items():
        if not name or "=" in name or "\0" in name or "\0" in value:
            raise OpError("bad_request", f"cell: {name[:60]!r} is not an environment "
                          "variable's name (or its value has a NUL)")
    return dict(raw)


def _cwd() -> str | None:
    try:
        return os.getcwd()
    except OSError:
        return None


def _restore(saved_env: dict[str, str | None], cwd: str | None) -> None:
    for name, value in saved_env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    try:
        os.chdir(cwd or "/")
    except OSError:
        os.chdir("/")


def _error(name: str, value: str, tb: str) -> dict[str, str]:
    return {"name": name, "value": value, "traceback": tb}


def _exception(exc: BaseException, filename: str, timeout: float) -> dict[str, str]:
    text = traceback_text(exc, filename)     # from the cell's first frame
    value = str(exc)
    if isinstance(exc, CellTimeout) and not value:
        value = f"the cell ran longer than its {timeout:g} s and was interrupted"
    elif isinstance(exc, KeyboardInterrupt) and not value:
        value = "interrupted: the client went away"
    return _error(type(exc).__name__, value, text)


def _bundle(value: Any, figures: set[int]) -> dict[str, Any]:
    """The representations of a cell's value (see the module doc)."""
    try:
        text = repr(value)
    except Exception as exc:  # noqa: BLE001 - a broken __repr__ is the cell's business
        text = f"<repr() failed: {type(exc).__name__}: {exc}>"
    out: dict[str, Any] = {"text": text[:MAX_TEXT_CHARS]}
    if isinstance(value, type):
        return out      # a class's _repr_*_ are unbound functions
    for method, key in _REPRS:
        try:
            fn = getattr(value, method, None)
            data = fn() if callable(fn) else None
        except Exception:  # noqa: BLE001, S112 - a representation that fails is left out
            continue
        if isinstance(data, tuple) and data:
            data = data[0]              # (data, metadata), as IPython allows
        if key in _BINARY and isinstance(data, (bytes, bytearray)):
            out[key] = base64.b64encode(data).decode("ascii")
        elif key == "json" and isinstance(data, (dict, list)):
            out[key] = data
        elif isinstance(data, str):
            out[key] = data
    if "png" not in out and _is_figure(value):
        png = _figure_png(value)
        if png is not None:
            out["png"] = png
            figures.add(id(value))
    return out


def _is_figure(value: Any) -> bool:
    return (type(value).__module__.startswith("matplotlib")
            and callable(getattr(value, "savefig", None)))


def _figure_png(figure: Any) -> str | None:
    buffer = io.BytesIO()
    try:
        figure.savefig(buffer, format="png")
    except Exception:  # noqa: BLE001 - a figure that cannot be drawn is left out
        return None
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _open_figures(seen: set[int]) -> list[dict[str, Any]]:
    """PNGs of the figures ``matplotlib.pyplot`` holds open (if the code imported it),
    which are then closed, as a notebook shows and forgets them."""
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is None:
        return []
    out = []
    try:
        for number in list(pyplot.get_fignums()):
            figure = pyplot.figure(number)
            if id(figure) not in seen:
                png = _figure_png(figure)
                if png is not None:
                    out.append({"text": repr(figure)[:MAX_TEXT_CHARS], "png": png})
            pyplot.close(figure)
    except Exception:  # noqa: BLE001, S110 - pyplot in a state of the cell's making
        pass
    return out


def _result_json(bundle: dict[str, Any], main: bool) -> bytes:
    data = json.dumps({**bundle, "is_main_result": main}).encode()
    if len(data) > MAX_RESULT_BYTES:
        data = _text_only(bundle, main, f"the result's representations are over "
                          f"{MAX_RESULT_BYTES} bytes")
    return data


def _text_only(bundle: dict[str, Any], main: bool, reason: str) -> bytes:
    kept = {"text": bundle["text"], "extra": {
        "vmfork_dropped": sorted(k for k in bundle if k != "text"), "reason": reason}}
    return json.dumps({**kept, "is_main_result": main}).encode()
