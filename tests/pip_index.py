"""A package index for the guests: the wheels the set-up fetched (``scripts/lib.sh``,
``setup_test_wheels``) served as a PEP 503 "simple" repository over HTTP.

Real pip talks to it as to PyPI: ``/simple/`` lists the projects, ``/simple/<name>/``
links each file with its ``#sha256=`` (pip checks it), ``/files/<wheel>`` serves the
bytes. The tree is written once into a directory and served by ``http.server``, so
what the guest downloads is exactly the file the set-up fetched and pinned.

Run as ``python -m tests.pip_index ADDRESS PORT [WHEEL_DIR]`` (in a network namespace,
``ip netns exec NS python -m tests.pip_index ...``): it prints ``ready`` once it serves.
"""

from __future__ import annotations

import hashlib
import html
import http.server
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from vmfork.paths import cache_dir

# What the set-up fetches (pinned; cp311 manylinux wheels for the guest's Python 3.11).
# pandas and its dependencies are for forkd's README chain (numpy, then pandas on top;
# bench/pip_chain.py).
WHEELS = ("six==1.16.0", "idna==3.7", "numpy==2.0.2", "pandas==2.2.3",
          "python-dateutil==2.9.0.post0", "pytz==2024.2", "tzdata==2024.2")


# The installed size of the packages named, measured in the guest: every file of each
# distribution's RECORD (what pip wrote, .pyc files included), printed as two numbers:
# the files' apparent bytes (st_size) and the bytes the file system allocated for them
# (st_blocks, what du counts: on the guest's tmpfs root, whole 4 KiB pages). The
# pip-chain test and bench/pip_chain.py both measure layers against it.
INSTALLED = ("import importlib.metadata as m, os, sys\n"
             "apparent = allocated = 0\n"
             "for name in sys.argv[1:]:\n"
             "    for f in m.distribution(name).files or ():\n"
             "        p = f.locate()\n"
             "        if os.path.isfile(p):\n"
             "            st = os.stat(p)\n"
             "            apparent += st.st_size\n"
             "            allocated += st.st_blocks * 512\n"
             "print(apparent, allocated)\n")


def wheel_dir() -> Path:
    return cache_dir() / "test-assets" / "wheels"


def normalize(name: str) -> str:
    """PEP 503's normalised project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def build_tree(wheels: Path, root: Path) -> list[str]:
    """Write the simple index for every wheel in ``wheels`` under ``root``; the project
    names. The wheels are hard-linked (or copied) into ``root/files``."""
    files = sorted(wheels.glob("*.whl"))
    if not files:
        raise FileNotFoundError(f"no wheels in {wheels}: run the set-up (scripts/test or "
                                "`source scripts/lib.sh; setup_python; setup_test_wheels`)")
    (root / "files").mkdir(parents=True, exist_ok=True)
    projects: dict[str, list[tuple[str, str]]] = {}
    for wheel in files:
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        target = root / "files" / wheel.name
        try:
            target.hardlink_to(wheel)
        except OSError:
            shutil.copyfile(wheel, target)
        projects.setdefault(normalize(wheel.name.split("-", 1)[0]), []).append(
            (wheel.name, digest))
    simple = root / "simple"
    simple.mkdir(exist_ok=True)
    links = "".join(f'<a href="{p}/">{p}</a>\n' for p in sorted(projects))
    (simple / "index.html").write_text(f"<!DOCTYPE html>\n<html><body>\n{links}</body></html>\n")
    for project, entries in projects.items():
        (simple / project).mkdir(exist_ok=True)
        anchors = "".join(f'<a href="../../files/{html.escape(n)}#sha256={d}">'
                          f"{html.escape(n)}</a>\n" for n, d in entries)
        (simple / project / "index.html").write_text(
            f"<!DOCTYPE html>\n<html><body>\n{anchors}</body></html>\n")
    return sorted(projects)


def serve(address: str, port: int, wheels: Path) -> None:
    root = Path(tempfile.mkdtemp(prefix="vmfork-index-"))
    try:
        build_tree(wheels, root)

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *args: object, **kwargs: object) -> None:
                super().__init__(*args, directory=str(root), **kwargs)  # type: ignore[arg-type]

            def log_message(self, format: str, *args: object) -> None:
                sys.stderr.write(f"index: {format % args}\n")

        server = http.server.ThreadingHTTPServer((address, port), Handler)
        print("ready", flush=True)
        server.serve_forever()
    finally:
        shutil.rmtree(root, ignore_errors=True)


REPO = Path(__file__).resolve().parents[1]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextmanager
def index_on_the_internet(namespace: str, *, host_side: str = "198.51.100.1",
                          address: str = "198.51.100.10", port: int = 8000,
                          link: str = "cinet") -> Iterator[str]:
    """The index served in network namespace ``namespace``, standing for the internet
    (a /24 routed from the host over a veth ``<link>0``/``<link>1``), so guests reach
    it through their NAT and egress policy as they would reach PyPI; yields its
    ``/simple`` URL. Needs root; everything it made is removed afterwards."""
    if not any(wheel_dir().glob("*.whl")):
        raise FileNotFoundError(f"no test wheels in {wheel_dir()}: the set-up fetches them "
                                "(scripts/lib.sh setup_test_wheels)")
    url = f"http://{address}:{port}/simple"
    subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)
    _ip("netns", "add", namespace)
    server = None
    try:
        _ip("link", "add", f"{link}0", "type", "veth", "peer", "name", f"{link}1",
            "netns", namespace)
        _ip("addr", "add", f"{host_side}/24", "dev", f"{link}0")
        _ip("link", "set", f"{link}0", "up")
        for cmd in (["link", "set", "lo", "up"], ["link", "set", f"{link}1", "up"],
                    ["addr", "add", f"{address}/24", "dev", f"{link}1"],
                    ["route", "add", "default", "via", host_side]):
            _ip("-n", namespace, *cmd)
        server = subprocess.Popen(
            ["ip", "netns", "exec", namespace, sys.executable, "-m", "tests.pip_index",
             address, str(port), str(wheel_dir())], cwd=REPO, stdout=subprocess.PIPE,
            env=dict(os.environ, PYTHONPATH=f"{REPO / 'src'}{os.pathsep}{REPO}"))
        assert server.stdout is not None
        if server.stdout.readline().strip() != b"ready":
            raise RuntimeError("the package index did not start")
        with urllib.request.urlopen(f"{url}/", timeout=30) as r:
            r.read()
        yield url
    finally:
        if server is not None:
            server.kill()
            server.wait()
        subprocess.run(["ip", "link", "del", f"{link}0"], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]) if len(sys.argv) > 3 else wheel_dir())
