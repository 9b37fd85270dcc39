"""An E2B program for sandbox lifecycles (run like tour.py: ``python lifecycle.py
TEMPLATE``): timeout and set_timeout, metadata and a filtered list, sandbox-wide envs,
pause, connect resuming into the same id, metrics, kill. Prints one JSON object."""

import json
import sys
import time

from e2b import Sandbox, SandboxQuery


def main() -> None:
    seen: dict = {}
    sandbox = Sandbox.create(template=sys.argv[1], timeout=120,
                             metadata={"who": "e2b-lifecycle"}, envs={"SANDBOX_WIDE": "yes"})
    try:
        seen["env"] = sandbox.commands.run("echo $SANDBOX_WIDE").stdout
        seen["end_in"] = sandbox.get_info().end_at.timestamp() - time.time()
        sandbox.set_timeout(600)
        seen["end_in_after"] = sandbox.get_info().end_at.timestamp() - time.time()
        mine = Sandbox.list(query=SandboxQuery(metadata={"who": "e2b-lifecycle"}))
        seen["filtered"] = [s.sandbox_id == sandbox.sandbox_id for s in mine.next_items()]
        seen["filtered_none"] = Sandbox.list(
            query=SandboxQuery(metadata={"who": "nobody"})).next_items()
        sandbox.pause()
        seen["states"] = [str(getattr(s.state, "value", s.state)) for s in
                          Sandbox.list().next_items() if s.sandbox_id == sandbox.sandbox_id]
        resumed = Sandbox.connect(sandbox.sandbox_id)
        seen["same_id"] = resumed.sandbox_id == sandbox.sandbox_id
        seen["env_after_resume"] = resumed.commands.run("echo $SANDBOX_WIDE").stdout
        seen["metrics"] = len(resumed.get_metrics())
    finally:
        seen["kill"] = Sandbox.kill(sandbox.sandbox_id)
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
