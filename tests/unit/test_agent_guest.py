"""The agent as the guest carries it: ``/opt/vmfork/vmfork/{__init__.py,agent/}`` run by
``python3 -IS`` (no site-packages), as the recommended ``/init`` does."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "vmfork"

CHECK = """
import sys
sys.path.insert(0, OPT)
import vmfork.agent.main
light = sorted(m for m in sys.modules if m.startswith("vmfork"))
assert light == ["vmfork", "vmfork.agent", "vmfork.agent.main"], light
import vmfork.agent.client, vmfork.agent.server, vmfork.agent.system
stdlib = set(sys.stdlib_module_names) | {"vmfork"}
foreign = sorted(m for m in sys.modules
                 if m.split(".")[0] not in stdlib and not m.startswith("_"))
assert not foreign, foreign
print("ok")
"""


def test_agent_imports_only_the_stdlib_from_the_guest_layout(tmp_path: Path) -> None:
    opt = tmp_path / "opt" / "vmfork"
    (opt / "vmfork" / "agent").mkdir(parents=True)
    shutil.copy(SRC / "__init__.py", opt / "vmfork" / "__init__.py")
    for module in (SRC / "agent").glob("*.py"):
        shutil.copy(module, opt / "vmfork" / "agent" / module.name)
    proc = subprocess.run([sys.executable, "-IS", "-c", f"OPT = {str(opt)!r}\n{CHECK}"],
                          capture_output=True, text=True, timeout=60, check=False,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
