"""The real E2B SDK (``e2b`` from the package index, pinned; its own venv, made by
``scripts/lib.sh setup_e2b_sdk``) for the tests that drive ``vmfork serve`` with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

E2B_SDK_VERSION = "2.63.0"
"""Kept equal to ``E2B_SDK_VERSION`` in scripts/lib.sh."""
PROGRAMS = Path(__file__).parent / "e2b_programs"


def sdk_python() -> Path | None:
    """The E2B SDK venv's interpreter, or None when the set-up has not made it."""
    cache = Path(os.environ.get("VMFORK_CACHE_DIR") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vmfork")
    venv = cache / f"e2b-{E2B_SDK_VERSION}"
    python = venv / "bin" / "python"
    return python if python.exists() and (venv / ".complete").exists() else None


def e2b_env(api_url: str, key: str, ca_file: str | None = None) -> dict[str, str]:
    """What an E2B user sets to point the SDK at vmfork: nothing else."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update(E2B_API_KEY=key, E2B_API_URL=api_url, E2B_SANDBOX_URL=api_url)
    if ca_file is not None:
        env["SSL_CERT_FILE"] = ca_file
    return env


def run_program(python: Path, name: str, args: list[str], env: dict[str, str],
                timeout: float = 300) -> dict:
    """Run ``tests/e2b_programs/<name>.py`` with the SDK; its one JSON line of output."""
    done = subprocess.run([str(python), str(PROGRAMS / f"{name}.py"), *args], env=env,
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        sys.stderr.write(done.stderr)
        raise AssertionError(f"{name}.py exited {done.returncode}: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
