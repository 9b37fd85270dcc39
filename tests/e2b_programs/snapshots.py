"""An E2B program for named snapshots (run like tour.py: ``python snapshots.py
TEMPLATE WORKDIR``): create_snapshot (named and not), list_snapshots (the sandbox's and
all), Sandbox.create from a snapshot id, delete_snapshot. Prints one JSON object."""

import json
import sys

from e2b import Sandbox, SandboxException


def main() -> None:
    seen: dict = {}
    template, work = sys.argv[1], sys.argv[2]
    sandbox = Sandbox.create(template=template)
    spawned = None
    try:
        sandbox.files.write(f"{work}/state.txt", "before the snapshot")
        named = sandbox.create_snapshot(name="e2b-named-snapshot")
        seen["named"] = {"id": named.snapshot_id, "names": named.names}
        sandbox.files.write(f"{work}/state.txt", "after the snapshot")
        unnamed = sandbox.create_snapshot()
        seen["unnamed_differs"] = unnamed.snapshot_id != named.snapshot_id
        seen["source_runs"] = sandbox.is_running()
        mine = sandbox.list_snapshots().next_items()
        seen["mine"] = sorted(s.snapshot_id for s in mine) == sorted(
            [named.snapshot_id, unnamed.snapshot_id])
        everything = Sandbox.list_snapshots()
        seen["all_has_named"] = named.snapshot_id in [s.snapshot_id for s in
                                                      everything.next_items()]
        seen["by_name"] = [s.snapshot_id for s in
                           Sandbox.list_snapshots(name=named.snapshot_id).next_items()]
        paged = Sandbox.list_snapshots(sandbox_id=sandbox.sandbox_id, limit=1)
        first = paged.next_items()
        seen["paged"] = [len(first), paged.has_next, len(paged.next_items()), paged.has_next]
        try:
            sandbox.create_snapshot(mode="filesystem")
            seen["filesystem_only"] = None
        except SandboxException as err:
            seen["filesystem_only"] = str(err)
        try:
            sandbox.create_snapshot(name=named.snapshot_id)
            seen["name_taken"] = None
        except SandboxException as err:
            seen["name_taken"] = str(err)

        spawned = Sandbox.create(template=named.snapshot_id)
        seen["spawned_reads"] = spawned.files.read(f"{work}/state.txt")
        seen["spawned_template"] = spawned.get_info().template_id
        spawned.kill()
        spawned = None
        seen["deleted"] = Sandbox.delete_snapshot(named.snapshot_id)
        seen["deleted_again"] = Sandbox.delete_snapshot(named.snapshot_id)
        seen["deleted_unnamed"] = Sandbox.delete_snapshot(unnamed.snapshot_id)
        seen["left"] = [s.snapshot_id for s in sandbox.list_snapshots().next_items()]
        try:
            Sandbox.create(template=named.snapshot_id)
            seen["create_from_deleted"] = None
        except SandboxException as err:
            seen["create_from_deleted"] = type(err).__name__
    finally:
        if spawned is not None:
            spawned.kill()
        sandbox.kill()
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
