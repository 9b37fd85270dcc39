"""The real E2B SDK (``e2b`` from the package index, pinned; its own venv, made by
``scripts/lib.sh setup_e2b_sdk``) for the tests that drive ``vmfork serve`` with it."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

E2B_SDK_VERSION = "2.63.0"
"""Kept equal to ``E2B_SDK_VERSION`` in scripts/lib.sh."""
E2B_JS_SDK_VERSION = "2.51.0"
"""The JavaScript SDK (``e2b`` on the npm registry); ``E2B_JS_SDK_VERSION`` there."""
E2B_INTERPRETER_VERSION = "2.11.5"
"""``e2b-code-interpreter`` (with e2b 2.63.0), ``E2B_INTERPRETER_VERSION`` in lib.sh."""
E2B_JS_INTERPRETER_VERSION = "2.8.0"
"""``@e2b/code-interpreter`` (with e2b 2.51.0), ``E2B_JS_INTERPRETER_VERSION`` there."""
PROGRAMS = Path(__file__).parent / "e2b_programs"


def _cache() -> Path:
    return Path(os.environ.get("VMFORK_CACHE_DIR") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vmfork")


def sdk_node_modules() -> Path:
    """The JavaScript SDK's ``node_modules`` (the set-up installs it)."""
    where = _cache() / f"e2b-js-{E2B_JS_SDK_VERSION}"
    if not (where / ".complete").exists():
        raise AssertionError(f"e2b {E2B_JS_SDK_VERSION} (npm) is not installed at {where}: "
                             "run the set-up (scripts/test, or scripts/lib.sh setup_e2b_sdk)")
    return where / "node_modules"


def sdk_python() -> Path:
    """The E2B SDK venv's interpreter (the set-up makes it; a test fails without it)."""
    venv = _cache() / f"e2b-{E2B_SDK_VERSION}"
    python = venv / "bin" / "python"
    if not (python.exists() and (venv / ".complete").exists()):
        raise AssertionError(f"e2b {E2B_SDK_VERSION} is not installed at {venv}: run the "
                             "set-up (scripts/test, or scripts/lib.sh setup_e2b_sdk)")
    return python


def interpreter_python() -> Path:
    """The code-interpreter SDK venv's interpreter (``e2b-code-interpreter``)."""
    venv = _cache() / f"e2b-code-interpreter-{E2B_INTERPRETER_VERSION}"
    python = venv / "bin" / "python"
    if not (python.exists() and (venv / ".complete").exists()):
        raise AssertionError(f"e2b-code-interpreter {E2B_INTERPRETER_VERSION} is not "
                             f"installed at {venv}: run the set-up (scripts/test, or "
                             "scripts/lib.sh setup_e2b_sdk)")
    return python


def interpreter_node_modules() -> Path:
    """``@e2b/code-interpreter``'s ``node_modules`` (the set-up installs it)."""
    where = _cache() / f"e2b-code-interpreter-js-{E2B_JS_INTERPRETER_VERSION}"
    if not (where / ".complete").exists():
        raise AssertionError(f"@e2b/code-interpreter {E2B_JS_INTERPRETER_VERSION} is not "
                             f"installed at {where}: run the set-up (scripts/lib.sh "
                             "setup_e2b_sdk)")
    return where / "node_modules"


def check_interpreter(seen: dict) -> None:
    """What tests/e2b_programs/interpreter.py and interpreter.cjs must have seen."""
    value = seen["value"]
    assert value["text"] == "42" and value["error"] is False, value
    assert value["stdout"] == ["hello\n"] and value["stderr"] == ["warn\n"], value
    assert value["chunks"] == ["hello\n"] and value["count"] == 1, value
    assert seen["persists"] == "82"
    error = seen["error"]
    assert error["name"] == "ValueError" and error["value"] == "bad value", error
    assert "raise ValueError('bad value')" in error["traceback"], error
    assert "in f" in error["traceback"] and error["text"] is None, error
    # stdout arrives as it is printed: the two lines 1.5 s apart, not together at the end.
    assert seen["streamed_gap"] is not None and seen["streamed_gap"] > 1.0, seen
    assert seen["context_cwd"] == "/tmp" and seen["context_getcwd"] == "'/tmp'"
    assert seen["context_sees_x"] == "NameError" and seen["context_y"] == "'mine'"
    assert seen["default_sees_y"] == "NameError" and seen["listed"] is True
    assert seen["after_restart"] == "NameError"
    assert seen["removed_context"] and "no code context" in seen["removed_context"], seen
    assert seen["env"] == "'from-envs'"
    rich = seen["rich"]
    assert rich["text"] == "Rich()" and rich["html"] == "<b>rich</b>", rich
    assert base64.b64decode(rich["png"]) == b"\x89PNG-bytes", rich
    assert {"html", "png"} <= set(rich["formats"]), rich
    # display() inside a cell: results in order, the trailing value the main one.
    displayed = seen["displayed"]
    assert displayed["error"] is None, displayed
    assert displayed["results"] == [
        {"text": "1", "html": None, "main": False},
        {"text": "Rich()", "html": "<b>rich</b>", "main": False},
        {"text": "'two'", "html": None, "main": False},
        {"text": "'end'", "html": None, "main": True}], displayed
    assert displayed["text"] == "'end'" and displayed["stdout"] == ["before\n"], displayed
    # The SDK's own timeout hangs up; the cell is interrupted and the next one runs.
    assert seen["timed_out"] and "timed out" in seen["timed_out"].lower(), seen
    assert seen["after_timeout"] == "'alive'" and seen["after_timeout_secs"] < 30, seen
    if "plot_png" in seen:   # the image has matplotlib
        assert seen["plot_png"] and seen["plot_png"][0].startswith("iVBORw0KGgo"), seen


def e2b_env(api_url: str, key: str, ca_file: str | None = None) -> dict[str, str]:
    """What an E2B user sets to point the SDK at vmfork: nothing else."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update(E2B_API_KEY=key, E2B_API_URL=api_url, E2B_SANDBOX_URL=api_url)
    if ca_file is not None:   # how each runtime takes a CA beside the system's
        env.update(SSL_CERT_FILE=ca_file, NODE_EXTRA_CA_CERTS=ca_file)
    return env


def run_program(python: Path, name: str, args: list[str], env: dict[str, str],
                timeout: float = 300) -> dict:
    """Run ``tests/e2b_programs/<name>.py`` with the SDK; its one JSON line of output."""
    return _run([str(python), str(PROGRAMS / f"{name}.py"), *args], name, env, timeout)


def run_js_program(name: str, args: list[str], env: dict[str, str],
                   timeout: float = 300, node_modules: Path | None = None) -> dict:
    """Run ``tests/e2b_programs/<name>.cjs`` with the JavaScript SDK (or the one in
    ``node_modules``), likewise."""
    env = dict(env, NODE_PATH=str(node_modules or sdk_node_modules()))
    return _run(["node", str(PROGRAMS / f"{name}.cjs"), *args], name, env, timeout)


def _run(cmd: list[str], name: str, env: dict[str, str], timeout: float) -> dict:
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        sys.stderr.write(done.stderr)
        raise AssertionError(f"{name} exited {done.returncode}: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def check_tour(seen: dict, work: str) -> None:
    """What tests/e2b_programs/tour.py and tour.cjs must have seen."""
    assert seen["run"]["stdout"] == "hello\nhi-env" and seen["run"]["stderr"] == "oops\n"
    assert seen["run"]["exit_code"] == 0 and "".join(seen["run"]["chunks"]) == "hello\nhi-env"
    assert seen["pwd"] == work + "\n"
    assert seen["exit3"] == 3
    assert seen["echoed"] is True and seen["listed_cat"] is True and seen["killed"] is True
    assert seen["cat_end"]["stdout"] == "from stdin\n"
    assert seen["reconnected"] == "woke\n"
    assert seen["read"] == "alpha" and bytes(seen["read_bytes"]) == b"alpha"
    assert seen["exists"] == [True, False]
    assert seen["made"] == [True, False]
    assert seen["renamed"] == f"{work}/sub/b.txt"
    assert seen["list"] == [["b.txt", False], ["deeper", True]]
    assert seen["info_size"] == 5 and seen["removed"] is True and seen["big"] is True
    assert "watched.txt" in {name for name, _ in seen["watch"]}
    assert "30 100" in seen["pty"]
    assert seen["listed"] is True and seen["running"] is True
    assert seen["connected_run"] == "again\n"
    assert seen["forks"] == ["kept", "kept"] and seen["forks_distinct"] == 3
    assert seen["kill"] is True and seen["listed_after_kill"] is False


def check_signed_urls(seen: dict) -> None:
    """What tests/e2b_programs/signed_urls.py must have seen, by either routing."""
    for how in ("header", "host"):
        out = seen[how]
        for name in ("plain", "expiring", "as_root"):
            assert out[name] == {"status": 200, "body": "signed content"}, (how, name, out)
        refusals = {"expired": "signature is already expired",
                    "tampered": "invalid signature", "unsigned": "missing signature",
                    "other_path": "invalid signature", "other_user": "invalid signature",
                    "later_expiry": "invalid signature",
                    "other_sandbox": "invalid signature",
                    "read_url_posted": "invalid signature",
                    "write_url_read": "invalid signature"}
        for name, reason in refusals.items():
            assert out[name]["status"] == 401 and reason in out[name]["body"], (how, name, out)
        assert out["bad_expiry"]["status"] == 400, out
        assert out["upload"]["status"] == 200, out
        assert out["uploaded"] == f"uploaded via {how}"
    assert "signature_expiration=" in seen["urls"]["expiring"]
    assert "signature=v1_" in seen["urls"]["plain"]


def check_signed_urls_js(seen: dict) -> None:
    """What tests/e2b_programs/signed_urls.cjs must have seen."""
    assert seen["plain"] == {"status": 200, "body": "signed from js"}, seen
    assert seen["expiring"] == {"status": 200, "body": "signed from js"}, seen
    assert seen["expired"]["status"] == 401 and "expired" in seen["expired"]["body"], seen
    assert seen["upload"]["status"] == 200, seen
    assert seen["uploaded"] == "uploaded from js"
    assert seen["write_url_read"]["status"] == 401, seen


def check_users(seen: dict, name: str, uid: int, gid: int, home_dir: str, *,
                home: bool, default: tuple[int, int, str]) -> None:
    """What tests/e2b_programs/users.py must have seen for the user ``name``
    (``home_dir``: its home in the sandbox's /etc/passwd; ``default``: uid, gid and
    home of the user a call that names none runs as)."""
    first, second, third = seen["id"].splitlines()
    assert (first, second) == (name, str(uid))
    assert third.split() == [home_dir, name]
    assert seen["root_id"] == "root\n" and seen["default_id"] == f"{default[0]}\n", seen
    assert seen["default_file_owner"] == f"{default[0]}:{default[1]}\n", seen
    assert seen["default_pwd"] == f"{default[2]}\n", seen
    assert seen["background_id"] == f"{uid}\n"
    assert seen["file_owner"] == f"{uid}:{gid}\n"
    assert seen["dir_owners"] == f"{uid}:{gid}\n" * 3
    assert seen["root_file_owner"] == "0:0\n"
    assert seen["read_back"] == "mine"
    assert seen["upload_status"] == 200 and seen["upload_owner"] == f"{uid}:{gid}\n"
    assert seen["upload_url_user"] == name
    for refusal in ("unknown_run", "unknown_write"):
        assert seen[refusal] is not None and "no-such-user" in seen[refusal]["message"], seen
    assert seen["unknown_run"]["type"] == "InvalidArgumentException", seen
    assert seen["never_written"] is False
    if home:
        assert seen["home_pwd"] == f"/home/{name}\n"
        assert seen["relative"] == f"in my home\n{name}\n"
        assert seen["relative_read"] == "in my home"
        assert seen["root_relative"] == "/root\n"


def check_snapshots(seen: dict, *, isolated: bool) -> None:
    """What tests/e2b_programs/snapshots.py must have seen (``isolated``: each sandbox
    is a guest of its own, not an agent on the host that all of them share)."""
    assert seen["named"] == {"id": "e2b-named-snapshot", "names": ["e2b-named-snapshot"]}
    assert seen["unnamed_differs"] is True and seen["source_runs"] is True, seen
    assert seen["mine"] is True and seen["all_has_named"] is True, seen
    assert seen["by_name"] == ["e2b-named-snapshot"], seen
    assert seen["paged"] == [1, True, 1, False], seen
    assert seen["filesystem_only"] and "memory: false" in seen["filesystem_only"], seen
    assert seen["name_taken"] and "e2b-named-snapshot" in seen["name_taken"], seen
    # A sandbox from the snapshot sees the state it had then, not what came after.
    assert seen["spawned_reads"] == ("before the snapshot" if isolated
                                     else "after the snapshot"), seen
    assert seen["spawned_template"] == "e2b-named-snapshot", seen
    assert seen["deleted"] is True and seen["deleted_again"] is False, seen
    assert seen["deleted_unnamed"] is True and seen["left"] == [], seen
    assert seen["create_from_deleted"], seen
