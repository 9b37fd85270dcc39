"""An E2B program, unmodified E2B SDK calls only: where it runs is set by the
environment (E2B_API_KEY, E2B_API_URL, E2B_SANDBOX_URL), as for any E2B user. Run by
the tests with the SDK's own interpreter (its venv, scripts/lib.sh setup_e2b_sdk):

    python tour.py TEMPLATE WORKDIR

It prints one JSON object of what it saw; the tests assert on it. WORKDIR is an
absolute directory in the sandbox that the program may fill.
"""

import json
import sys
import threading
import time

from e2b import PtySize, Sandbox
from e2b.sandbox.commands.command_handle import CommandExitException
from e2b.sandbox.filesystem.filesystem import FileType


def main() -> None:
    template, work = sys.argv[1], sys.argv[2]
    seen: dict = {}
    sandbox = Sandbox.create(template=template)
    seen["id"] = sandbox.sandbox_id
    try:
        sandbox.files.make_dir(work)
        chunks: list[str] = []
        result = sandbox.commands.run("echo hello; echo oops >&2; printf \"$GREETING\"",
                                      envs={"GREETING": "hi-env"}, cwd=work,
                                      on_stdout=chunks.append)
        seen["run"] = {"stdout": result.stdout, "stderr": result.stderr,
                       "exit_code": result.exit_code, "chunks": chunks}
        seen["pwd"] = sandbox.commands.run("pwd", cwd=work).stdout
        try:
            sandbox.commands.run("exit 3")
            seen["exit3"] = None
        except CommandExitException as err:
            seen["exit3"] = err.exit_code

        cat = sandbox.commands.run("cat", background=True, stdin=True)
        sandbox.commands.send_stdin(cat.pid, "from stdin\n")
        echoed = threading.Event()
        follower = sandbox.commands.connect(cat.pid)

        def follow() -> None:
            for stdout, _stderr, _pty in follower:
                if stdout and "from stdin" in stdout:
                    echoed.set()
        threading.Thread(target=follow, daemon=True).start()
        seen["echoed"] = echoed.wait(30)
        listed = [p.pid for p in sandbox.commands.list()]
        seen["listed_cat"] = cat.pid in listed
        seen["killed"] = sandbox.commands.kill(cat.pid)
        try:
            cat.wait()
            seen["cat_end"] = "exited"
        except CommandExitException as err:
            seen["cat_end"] = {"exit_code": err.exit_code, "stdout": err.stdout,
                               "error": err.error}

        sleeper = sandbox.commands.run("sleep 1; echo woke", background=True)
        again = sandbox.commands.connect(sleeper.pid)
        seen["reconnected"] = again.wait().stdout

        sandbox.files.write(f"{work}/a.txt", "alpha")
        seen["read"] = sandbox.files.read(f"{work}/a.txt")
        seen["read_bytes"] = list(sandbox.files.read(f"{work}/a.txt", format="bytes"))
        seen["exists"] = [sandbox.files.exists(f"{work}/a.txt"),
                          sandbox.files.exists(f"{work}/nope")]
        seen["made"] = [sandbox.files.make_dir(f"{work}/sub/deeper"),
                        sandbox.files.make_dir(f"{work}/sub/deeper")]
        info = sandbox.files.rename(f"{work}/a.txt", f"{work}/sub/b.txt")
        seen["renamed"] = info.path
        entries = sandbox.files.list(f"{work}/sub")
        seen["list"] = sorted((e.name, e.type == FileType.DIR) for e in entries)
        seen["info_size"] = sandbox.files.get_info(f"{work}/sub/b.txt").size
        sandbox.files.remove(f"{work}/sub/b.txt")
        seen["removed"] = not sandbox.files.exists(f"{work}/sub/b.txt")
        big = "x" * (3 << 20)
        sandbox.files.write(f"{work}/big.txt", big)
        seen["big"] = sandbox.files.read(f"{work}/big.txt") == big

        events: list[tuple[str, str]] = []
        handle = sandbox.files.watch_dir(work)
        sandbox.files.write(f"{work}/watched.txt", "w")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(n == "watched.txt" for n, _ in events):
            events += [(e.name, e.type.name) for e in handle.get_new_events()]
            time.sleep(0.2)
        handle.stop()
        seen["watch"] = sorted(set(events))

        pty_out: list[bytes] = []
        terminal = sandbox.pty.create(size=PtySize(rows=24, cols=80), cwd=work)
        sandbox.pty.resize(terminal.pid, PtySize(rows=30, cols=100))
        sandbox.pty.send_stdin(terminal.pid, b"stty size; exit\n")
        pty_end = threading.Event()

        def wait() -> None:
            try:
                terminal.wait(on_pty=pty_out.append)
            except CommandExitException:
                pass
            pty_end.set()
        threading.Thread(target=wait, daemon=True).start()
        pty_end.wait(20)
        seen["pty"] = b"".join(pty_out).decode("utf-8", "replace")

        seen["listed"] = sandbox.sandbox_id in [s.sandbox_id for s in
                                                Sandbox.list().next_items()]
        seen["running"] = sandbox.is_running()
        other = Sandbox.connect(sandbox.sandbox_id)
        seen["connected_run"] = other.commands.run("echo again").stdout

        sandbox.files.write(f"{work}/before-fork.txt", "kept")
        forks = sandbox.fork(count=2)
        seen["forks"] = [f.files.read(f"{work}/before-fork.txt") for f in forks]
        seen["forks_distinct"] = len({f.sandbox_id for f in forks} | {sandbox.sandbox_id})
        for fork in forks:
            fork.kill()
    finally:
        seen["kill"] = sandbox.kill()
    seen["listed_after_kill"] = sandbox.sandbox_id in [s.sandbox_id for s in
                                                       Sandbox.list().next_items()]
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
