#!/usr/bin/env bash
# Run the TypeScript SDK's tests (built beforehand by scripts/lib.sh's
# setup_typescript, which needs the network; this script does not).
#
#   run-tests.sh unit   tests that start their own `vmfork serve` and spawn
#                       nothing: run anywhere
#   run-tests.sh e2e [NAME...]
#                       real sandboxes: needs a KVM that runs guests (the
#                       emulated test host here). Starts `vmfork serve` on a
#                       Unix socket with a temporary VMFORK_HOME, creates a
#                       small warm snapshot, runs the tests, stops the daemon.
set -euo pipefail
SDK=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$SDK/../../scripts/lib.sh"
setup_python   # the cached venv; sets PY and PYTHONPATH, installs nothing when present

if [ ! -d "$SDK/build-test/test" ]; then
  echo "run-tests.sh: the SDK is not built; run 'source scripts/lib.sh && setup_typescript' first" >&2
  exit 2
fi
export VMFORK_SDK_TEST_PYTHON=$PY

case ${1:-unit} in
  unit)
    exec node --test "$SDK"/build-test/test/*.test.js
    ;;
  e2e)
    work=$(mktemp -d "${TMPDIR:-/tmp}/vmfork-ts-e2e.XXXXXX")
    socket=$work/api.sock
    daemon=
    start_daemon() {
      VMFORK_HOME=$work/home "$PY" -m vmfork.cli.serve --state "$work/state" --socket "$socket" \
        >"$work/serve.log" 2>&1 &
      daemon=$!
    }
    trap stop_test_daemon EXIT   # scripts/lib.sh
    # Its first start in a fresh emulated host reads every module over 9p, and a
    # loaded machine can push the zygote past its 30 s start-up limit; the second
    # start finds them cached. One retry, said out loud.
    start_daemon
    for attempt in 1 2; do
      # It prints "listening" once its zygote answers; it exits if that fails.
      while kill -0 "$daemon" 2>/dev/null && ! grep -q "listening on" "$work/serve.log"; do
        sleep 0.2
      done
      grep -q "listening on" "$work/serve.log" && break
      wait "$daemon" || true
      if [ "$attempt" -eq 2 ]; then
        echo "run-tests.sh: vmfork serve did not start twice" >&2
        exit 1
      fi
      echo "run-tests.sh: vmfork serve did not start ($(tail -n 1 "$work/serve.log")); retrying once" >&2
      start_daemon
    done
    export VMFORK_URL=unix://$socket VMFORK_TEST_SNAPSHOT=ts-warm
    "$PY" - <<'PYEOF'
import os, time
from vmfork.client import Controller, ControllerError

ctl = Controller(os.environ["VMFORK_URL"], timeout=900)
deadline = time.monotonic() + 120
while True:
    try:
        ctl.healthz()
        break
    except ControllerError:
        if time.monotonic() > deadline:
            raise SystemExit("vmfork serve did not answer within 120 s")
        time.sleep(0.2)
started = time.monotonic()
info = ctl.create_snapshot(os.environ["VMFORK_TEST_SNAPSHOT"], mem_mib=256, warm_code="answer = 41")
print(f"snapshot {info['tag']}: {info['status']} in {time.monotonic() - started:.1f} s", flush=True)
PYEOF
    # A hung test fails (with its name) instead of hanging the test host until its timeout.
    # run-tests.sh e2e [NAME...]: only test/e2e/NAME.test.ts (default: all of them).
    shift || true
    files=("$SDK"/build-test/test/e2e/*.test.js)
    if [ "$#" -gt 0 ]; then
      files=()
      for name in "$@"; do files+=("$SDK/build-test/test/e2e/$name.test.js"); done
    fi
    node --test --test-timeout=900000 "${files[@]}"
    ;;
  *)
    echo "usage: run-tests.sh [unit|e2e]" >&2
    exit 2
    ;;
esac
