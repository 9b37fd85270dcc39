"""The SDK's ``Sandbox`` and ``AsyncSandbox`` against a real daemon whose spawner is
the fake one of ``test_server_http`` (no KVM): one implementation, two faces."""

from __future__ import annotations

import asyncio
import io
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_server_http import TOKEN, Served, _serve

from vmfork.client import AsyncSandbox, CommandHandle, CommandTimeout, Controller, Sandbox


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    # Room for the five concurrent creates below: the heavy-operation cap (503 past it)
    # is test_server_http's subject, not this file's.
    yield from _serve(tmp_path, TOKEN, heavy=8)


@pytest.fixture
def ctl(served: Served) -> Controller:
    c = Controller(served.url, token=TOKEN.decode(), timeout=10)
    c.create_snapshot("base")
    return c


def test_background_command_handle(ctl: Controller) -> None:
    seen: list[str] = []
    with Sandbox.create("base", controller=ctl) as sb:
        handle = sb.commands.run("echo hi", background=True, on_stdout=seen.append)
        assert isinstance(handle, CommandHandle)
        result = handle.wait(5)
        assert result.exit_code == 3 and result.stdout == "chunk1 chunk2" == handle.stdout
        assert seen == ["chunk1 ", "chunk2"] and handle.done
        late = sb.commands.run(["sleep", "1"], background=True, timeout=1)
        with pytest.raises(CommandTimeout):
            late.wait(5)


def test_files_stream_from_and_to_file_objects(ctl: Controller, tmp_path: Path) -> None:
    source = tmp_path / "blob"
    source.write_bytes(os.urandom(3 << 20))
    with Sandbox.create("base", controller=ctl) as sb, source.open("rb") as f:
        assert sb.files.write("/tmp/blob", f) == 3 << 20
        out = io.BytesIO()
        assert sb.files.read_to("/tmp/blob", out) == 3 << 20
        assert out.getvalue() == source.read_bytes()
        assert sb.files.stat("/tmp/blob")["size"] == 3 << 20
        sb.files.remove("/tmp/nothing", missing_ok=True)


def test_async_sandboxes_run_concurrently_with_callbacks_on_the_loop(
        ctl: Controller) -> None:
    async def one(n: int) -> tuple[str, list[int]]:
        threads: list[int] = []
        async with await AsyncSandbox.create("base", controller=ctl) as sb:
            await sb.files.write(f"/tmp/f{n}", f"data {n}")
            assert await sb.files.read(f"/tmp/f{n}") == f"data {n}".encode()
            assert (await sb.eval(f"{n} * 2")).result == str(n * 2)
            result = await sb.commands.run(
                "echo", on_stdout=lambda text: threads.append(threading.get_ident()))
            assert result.stdout == "chunk1 chunk2"
            handle = await sb.commands.run("echo", background=True)
            assert (await handle.wait()).exit_code == 3
            assert (await sb.ping())["pong"]
            return sb.id, threads

    async def main() -> list[tuple[str, list[int]]]:
        return await asyncio.gather(*(one(n) for n in range(5)))

    loop_thread = threading.get_ident()
    results = asyncio.run(main())
    assert len({sandbox for sandbox, _ in results}) == 5
    for _, threads in results:
        assert threads and set(threads) == {loop_thread}   # delivered on the event loop
    assert ctl.list_sandboxes() == []   # every ``async with`` killed its sandbox
