"""The ``eval`` op: Python in the agent's warm interpreter (stdlib only).

All evals share one globals dict, the ``__dict__`` of a module registered as
``sys.modules["vmfork_eval"]``, so imports and variables persist between calls and
functions and classes defined by eval code can be pickled (``multiprocessing`` works).
The last statement, if it is an expression, is evaluated separately and its ``repr``
is the result (a REPL's rule); anything else gives a null value.

Capturing output. Evals may run concurrently, each on its connection's thread, so
``contextlib.redirect_stdout`` (which swaps ``sys.stdout`` for every thread) would mix
their outputs. Instead ``sys.stdout``/``sys.stderr`` are wrapped once in a
``ThreadRoutedStream`` that writes to the current thread's capture target if it has
one and to the original stream (the console) otherwise. The target sends what it
collects to the host as ``stdout``/``stderr`` frames — when 64 KiB have accumulated,
when 50 ms have passed since the last frame, and at the end — so a long eval's prints
arrive while it runs. Threads the code starts print to the console, not to the caller.

An eval cannot be interrupted: Python threads cannot be killed. Code that never
returns occupies one connection thread for good; use ``exec`` for untrusted work.
``os._exit()`` in eval code ends PID 1, and with it the VM.
"""

from __future__ import annotations

import ast
import builtins
import io
import linecache
import sys
import threading
import time
import traceback
import types
from typing import Any, TextIO

from vmfork.agent.conn import Conn, PeerGone
from vmfork.agent.protocol import OUTPUT_CHUNK
from vmfork.agent.request import get_str

MAX_VALUE_CHARS = 128 << 10
"""A result's repr is cut to this many characters (``value_truncated`` is then set)."""
MAX_TRACEBACK_CHARS = 64 << 10
FLUSH_INTERVAL = 0.05
EVAL_MODULE = "vmfork_eval"


class _FrameSink:
    """One eval's stdout or stderr: text in, ``stdout``/``stderr`` frames out."""

    def __init__(self, conn: Conn, kind: str) -> None:
        self.conn = conn
        self.kind = kind
        self.buffer = bytearray()
        self.last_flush = time.monotonic()
        self.broken = False

    def write(self, text: str) -> None:
        self.buffer += text.encode("utf-8", "surrogateescape")
        if (len(self.buffer) >= OUTPUT_CHUNK
                or time.monotonic() - self.last_flush >= FLUSH_INTERVAL):
            self.flush()

    def flush(self) -> None:
        while self.buffer:
            chunk = bytes(self.buffer[:OUTPUT_CHUNK])
            del self.buffer[:OUTPUT_CHUNK]
            if not self.broken:
                try:
                    self.conn.send({"type": self.kind}, chunk)
                except PeerGone:
                    self.broken = True  # the caller left; let the code finish quietly
        self.last_flush = time.monotonic()


class ThreadRoutedStream(io.TextIOBase):
    """A ``sys.stdout`` stand-in that routes each thread's writes (see module doc)."""

    def __init__(self, fallback: TextIO | None) -> None:
        super().__init__()
        self.fallback = fallback
        self.local = threading.local()

    def _target(self) -> _FrameSink | TextIO | None:
        sink: _FrameSink | None = getattr(self.local, "sink", None)
        return sink if sink is not None else self.fallback

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        target = self._target()
        if target is not None:
            target.write(text)
        return len(text)

    def flush(self) -> None:
        target = self._target()
        if target is not None:
            target.flush()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def fileno(self) -> int:
        if getattr(self.local, "sink", None) is None and self.fallback is not None:
            return self.fallback.fileno()
        raise io.UnsupportedOperation("eval output is captured; it has no file descriptor")


_install_lock = threading.Lock()


def _routed(name: str) -> ThreadRoutedStream:
    """``sys.<name>`` as a ThreadRoutedStream, wrapping whatever is there now (test
    harnesses replace ``sys.stdout`` between tests, so this is checked per eval)."""
    with _install_lock:
        current = getattr(sys, name)
        if not isinstance(current, ThreadRoutedStream):
            current = ThreadRoutedStream(current)
            setattr(sys, name, current)
        return current


def traceback_text(exc: BaseException, filename: str) -> str:
    """``exc``'s traceback from the first frame of the code compiled as ``filename``
    (the agent's own frames dropped), its last ``MAX_TRACEBACK_CHARS`` characters."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != filename:
        tb = tb.tb_next
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    if len(text) > MAX_TRACEBACK_CHARS:
        text = "…" + text[-MAX_TRACEBACK_CHARS:]
    return text


def _exception_info(exc: BaseException, filename: str) -> dict[str, str]:
    return {"type": type(exc).__qualname__, "message": str(exc),
            "traceback": traceback_text(exc, filename)}


class Evaluator:
    """The persistent namespace and the ``eval`` op."""

    def __init__(self) -> None:
        module = types.ModuleType(EVAL_MODULE, "Namespace of the vmfork agent's eval op.")
        module.__dict__["__builtins__"] = builtins
        sys.modules.setdefault(EVAL_MODULE, module)
        self.namespace: dict[str, Any] = sys.modules[EVAL_MODULE].__dict__
        self._counter = 0
        self._counter_lock = threading.Lock()

    def _filename(self) -> str:
        with self._counter_lock:
            self._counter += 1
            return f"<eval-{self._counter}>"

    def run(self, code: str, filename: str) -> Any:
        """Run ``code``; return the value of its trailing expression (or None)."""
        tree = ast.parse(code, filename, "exec")
        last: ast.Expression | None = None
        if tree.body and isinstance(trailing := tree.body[-1], ast.Expr):
            tree.body.pop()
            last = ast.Expression(trailing.value)
        exec(compile(tree, filename, "exec"), self.namespace)  # noqa: S102 - the op's purpose
        if last is None:
            return None
        return eval(compile(last, filename, "eval"), self.namespace)

    def handle(self, conn: Conn, req: dict[str, Any]) -> None:
        code = get_str(req, "code")
        filename = self._filename()
        # Tracebacks show source lines for this code; dropped afterwards so that many
        # evals do not grow the cache without bound.
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        out, err = _FrameSink(conn, "stdout"), _FrameSink(conn, "stderr")
        stdout, stderr = _routed("stdout"), _routed("stderr")
        stdout.local.sink, stderr.local.sink = out, err
        value: str | None = None
        truncated = False
        exception: dict[str, str] | None = None
        try:
            try:
                result = self.run(code, filename)
                if result is not None:
                    value = repr(result)
            except BaseException as exc:  # noqa: BLE001 - SystemExit must not end PID 1
                exception = _exception_info(exc, filename)
        finally:
            stdout.local.sink = stderr.local.sink = None
            linecache.cache.pop(filename, None)
        out.flush()
        err.flush()
        if value is not None and len(value) > MAX_VALUE_CHARS:
            value, truncated = value[:MAX_VALUE_CHARS], True
        conn.result(value=value, value_truncated=truncated, exception=exception)
