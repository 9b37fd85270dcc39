"""The fuzzing tier: every target of ``tests/fuzz/targets.py`` under atheris
(libFuzzer's engine for Python, coverage-guided), each in a process of its own for
``--seconds`` (default 5), from its seed. A finding (an exception the parser does not
document, or a crash) fails the tier with the input that caused it, kept under
``--artifacts``. The corpus each run grows is thrown away: the tier is a time-bounded
smoke of the parsers, not a fuzzing campaign.

    python -m tests.fuzz.run [--seconds N] [target ...]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def _fuzz_one(name: str, seconds: int, artifacts: Path) -> int:
    """In this process: run target ``name`` under atheris until time is up (exits)."""
    import atheris

    with atheris.instrument_imports():
        from tests.fuzz import targets
    corpus = Path(tempfile.mkdtemp(prefix=f"fuzz-{name}-"))
    (corpus / "seed").write_bytes(targets.SEEDS[name]())
    target = targets.TARGETS[name]
    argv = [sys.argv[0], f"-max_total_time={seconds}", "-timeout=10", "-rss_limit_mb=2048",
            f"-artifact_prefix={artifacts}/{name}-", "-print_final_stats=1", str(corpus)]
    atheris.Setup(argv, target)
    atheris.Fuzz()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz.run")
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--artifacts", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--one", help=argparse.SUPPRESS)   # the per-target child
    parser.add_argument("targets", nargs="*")
    args = parser.parse_args()
    if args.one:
        return _fuzz_one(args.one, args.seconds, args.artifacts)
    from tests.fuzz.targets import TARGETS
    names = args.targets or list(TARGETS)
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        parser.error(f"unknown target(s) {', '.join(unknown)}; known: {', '.join(TARGETS)}")
    failed = []
    for name in names:
        print(f"fuzz: {name} for {args.seconds} s", flush=True)
        # Each target in its own process: atheris.Fuzz() never returns, and one
        # target's instrumentation and state must not leak into another's.
        code = subprocess.call([sys.executable, "-m", "tests.fuzz.run", "--one", name,
                                "--seconds", str(args.seconds),
                                "--artifacts", str(args.artifacts)],
                               env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                   filter(None, ["src", ".", os.environ.get("PYTHONPATH")]))})
        if code != 0:
            failed.append(f"{name} (exit {code}; input under {args.artifacts}/{name}-*)")
    if failed:
        print("fuzz: FAILED: " + "; ".join(failed), file=sys.stderr)
        return 1
    print(f"fuzz: {len(names)} targets, no finding")
    return 0


if __name__ == "__main__":
    sys.exit(main())
