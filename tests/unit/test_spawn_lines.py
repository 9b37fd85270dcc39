"""The spawner's wait loop (``runtime/spawn.py``): what a child's FIFO line is taken for.

Real FIFOs and real status files; no zygote or VM (the e2e tier spawns real children)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from vmfork.runtime import spawn
from vmfork.runtime.spawn import Child


def test_lines_give_each_childs_last_state(tmp_path: Path) -> None:
    fifo = spawn._Fifo.create(tmp_path / ".notify")
    try:
        writer = os.open(fifo.path, os.O_WRONLY | os.O_NONBLOCK)
        os.write(writer, b"vm-a prepared\nvm-b prepared\nvm-a restored\nvm-c\n")
        os.close(writer)
        assert spawn._read_notifications(fifo.fd) == {"vm-a": "restored", "vm-b": "prepared",
                                                      "vm-c": ""}
        assert spawn._read_notifications(fifo.fd) == {}
    finally:
        fifo.remove()


def test_a_line_short_of_the_state_waited_for_is_taken_without_reading_the_file(
        tmp_path: Path) -> None:
    """``prepared`` and ``restored`` lines are enough while the spawner waits for
    ``ready``: the child's status.json (here still ``prepared``) is not read. The state
    waited for, a failure, a line of no known state and the full scan (no line) read
    the file, whose content the caller keeps (``Child.status``)."""
    child = Child("vm-a", 1, tmp_path)
    (tmp_path / "status.json").write_text(json.dumps({"state": "prepared", "restore_s": 0.1}))
    assert spawn._state_of(child, "restored", ("ready",)) == "restored"
    assert child.status == {}
    for line, done in (("restored", ("restored", "ready")), ("failed", ("ready",)),
                       ("", ("ready",)), (None, ("ready",))):
        child.status = {}
        assert spawn._state_of(child, line, done) == "prepared"
        assert child.status["restore_s"] == 0.1
