#!/usr/bin/env bash
# The dashboard's end-to-end test (tests/ui/dashboard.test.mjs): starts `vmfork serve`
# with a token on a loopback port and a temporary VMFORK_HOME, makes a small warm
# snapshot, runs the test in Debian's chromium through playwright-core, stops the
# daemon. Needs a KVM that runs guests (the emulated test host here) and the set-up's
# `setup_ui` (playwright-core in tests/ui/node_modules, chromium from Debian).
#
#   VMFORK_UI_ARTIFACTS   where the screenshots go (default test-artifacts/ui)
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/../../scripts/lib.sh"
setup_python   # the cached venv; installs nothing when present
if [ ! -d "$HERE/node_modules/playwright-core" ]; then
  echo "tests/ui/run.sh: playwright-core is not installed; run 'source scripts/lib.sh && setup_ui' first" >&2
  exit 2
fi
command -v chromium >/dev/null || { echo "tests/ui/run.sh: Debian's chromium is missing (setup_debian installs it)" >&2; exit 2; }
export VMFORK_UI_ARTIFACTS=${VMFORK_UI_ARTIFACTS:-$REPO/test-artifacts/ui}
mkdir -p "$VMFORK_UI_ARTIFACTS"

work=$(mktemp -d "${TMPDIR:-/tmp}/vmfork-ui.XXXXXX")
token=$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')
printf '%s' "$token" > "$work/token"
port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
daemon=
trap stop_test_daemon EXIT   # scripts/lib.sh
VMFORK_HOME=$work/home "$PY" -m vmfork.cli.serve --state "$work/state" --no-socket \
  --bind "127.0.0.1:$port" --token-file "$work/token" >"$work/serve.log" 2>&1 &
daemon=$!
while kill -0 "$daemon" 2>/dev/null && ! grep -q "listening on" "$work/serve.log"; do sleep 0.2; done
grep -q "listening on" "$work/serve.log" || { echo "tests/ui/run.sh: vmfork serve did not start" >&2; exit 1; }

export VMFORK_UI_URL=http://127.0.0.1:$port VMFORK_UI_TOKEN=$token VMFORK_UI_SNAPSHOT=ui-warm
"$PY" - <<'PYEOF'
import os, time
from vmfork.client import Controller

ctl = Controller(os.environ["VMFORK_UI_URL"], token=os.environ["VMFORK_UI_TOKEN"], timeout=900)
started = time.monotonic()
info = ctl.create_snapshot(os.environ["VMFORK_UI_SNAPSHOT"], mem_mib=256, warm_code="answer = 41")
print(f"snapshot {info['tag']}: {info['status']} in {time.monotonic() - started:.1f} s", flush=True)
PYEOF
cd "$HERE"
node --test --test-timeout=1500000 dashboard.test.mjs
echo "screenshots: $VMFORK_UI_ARTIFACTS"
