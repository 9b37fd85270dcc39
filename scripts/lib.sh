# Shared by scripts/demo and scripts/test: set up everything vmfork needs,
# idempotently, with what is built cached under the user's cache directory.
#
#   Debian packages   installed once (dpkg -s tells what is missing)
#   Python venv       $CACHE/venv-<hash of requirements>, with the dev tools
#   native core       native/ (Rust, PyO3) built by maturin into src/vmfork/_core.abi3.so
#                     (gitignored), cargo's target directory in $CACHE/cargo-target
#   guest image       vmfork image build (kernel + initramfs, content-addressed)
#   TypeScript SDK    npm ci into sdk/typescript/node_modules (npm cache under
#                     $CACHE/npm), then tsc; here, never in the test host (no network)
#   vmfork launcher   /usr/local/bin/vmfork (or ~/.local/bin/vmfork when not root):
#                     runs this checkout with the venv, so a new shell has `vmfork`
#   test images       (scripts/test only) the users' images the tests boot, built
#                     here from tests/images/*.toml, where the registries are reachable
#   test wheels       (scripts/test only) the pinned wheels the guests' package index
#                     serves (tests/pip_index.py), under $CACHE/test-assets/wheels
#   forkd-mcp         (scripts/test only) forkd's own MCP server, pinned, in a venv of its
#                     own under $CACHE/forkd-mcp-<version> (it needs mcp < 2; ours is 2.x)
#
# The project itself is not installed into the venv: PYTHONPATH points at this
# checkout's src/, so several clones can share one cache.

set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${VMFORK_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/vmfork}
export VMFORK_CACHE_DIR=$CACHE
export PYTHONPATH=$REPO/src${PYTHONPATH:+:$PYTHONPATH}

DEBIAN_PACKAGES=(
  qemu-system-x86 linux-image-amd64 linux-source-6.1 busybox-static cpio zstd
  bc flex bison libelf-dev libssl-dev build-essential kmod python3 nftables iperf3
  squashfs-tools erofs-utils  # users' images: their read-only root disks
  docker-registry skopeo apache2-utils openssl  # OCI import tests: a real registry, its client, htpasswd, token signing
)
# The quality gates' tools pinned (pyproject.toml's dev extra says the same): a new
# mypy or ruff changes what passes; atheris runs the fuzzing tier (tests/fuzz).
PYTHON_REQUIREMENTS=(pytest pytest-timeout hypothesis schemathesis pyroute2 cryptography prometheus_client httpx
                     "uvicorn>=0.30,<1" "starlette>=0.40,<2" mcp maturin
                     mypy==2.4.1 ruff==0.17.6 atheris==3.0.0)

log() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

need_root() {
  if [ "$(id -u)" -ne 0 ]; then
    echo "vmfork setup: installing Debian packages needs root (or install them yourself: ${DEBIAN_PACKAGES[*]})" >&2
    exit 1
  fi
}

install_debian_packages() {  # package...: installs those not installed yet
  local missing=() pkg
  for pkg in "$@"; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    need_root
    log "installing Debian packages: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

setup_debian() {
  install_debian_packages "${DEBIAN_PACKAGES[@]}"
}

# A `vmfork serve` a test script started (its pid in $daemon, its files in $work, its
# log $work/serve.log): the script's EXIT trap. Stops it, shows its log's tail when the
# script failed, removes $work, and exits with the script's status.
stop_test_daemon() {
  local rc=$?
  if [ -n "${daemon:-}" ] && kill -0 "$daemon" 2>/dev/null; then
    kill -TERM "$daemon"
    wait "$daemon" || true
  fi
  if [ "$rc" -ne 0 ] && [ -f "$work/serve.log" ]; then
    echo "--- vmfork serve log (last 40 lines) ---" >&2
    tail -n 40 "$work/serve.log" >&2
  fi
  rm -rf "$work"
  exit "$rc"
}

setup_python() {
  local base_python=${VMFORK_PYTHON:-python3}
  local key
  key=$(printf '%s\n' "$("$base_python" -c 'import sys; print(sys.version)')" "${PYTHON_REQUIREMENTS[@]}" | sha256sum | cut -c1-16)
  VENV=$CACHE/venv-$key
  if [ ! -x "$VENV/bin/python" ] || [ ! -f "$VENV/.complete" ]; then
    log "creating the Python environment in $VENV"
    rm -rf "$VENV"
    mkdir -p "$CACHE"
    "$base_python" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "${PYTHON_REQUIREMENTS[@]}"
    touch "$VENV/.complete"
  fi
  PY=$VENV/bin/python
  export PATH=$VENV/bin:$PATH
}

# The native core: maturin builds the wheel `pip install .` would (the same
# [tool.maturin] settings), and its extension module is placed in src/vmfork/, since
# this checkout runs from PYTHONPATH=src. Cargo rebuilds only what changed: its
# target directory (and the crates it downloaded, in CARGO_HOME) outlive the run.
# The module is replaced by rename, so a VMM process that has the old one loaded
# keeps it intact. VMFORK_CARGO_TARGET names another target directory (a second
# worktree building its own core beside this one).
setup_native() {
  [ -n "${VENV:-}" ] || setup_python   # maturin and the interpreter come from the venv
  # rustup's default place, for shells (and CI) whose PATH does not name it
  if ! command -v cargo >/dev/null && [ -x "$HOME/.cargo/bin/cargo" ]; then
    export PATH=$HOME/.cargo/bin:$PATH
  fi
  if ! command -v cargo >/dev/null; then
    echo "vmfork setup: the native core (native/) needs Rust and cargo on PATH (rustup, or Debian's cargo)" >&2
    exit 1
  fi
  log "native core (native/ -> src/vmfork/_core.abi3.so)"
  local out
  mkdir -p "$CACHE"
  out=$(mktemp -d "$CACHE/native-wheel.XXXXXX")
  local target=${VMFORK_CARGO_TARGET:-$CACHE/cargo-target}
  mkdir -p "$target"
  # One build at a time in a target directory: maturin moves the library through a
  # path of its own there, and two set-ups at once (the demo beside the tests) broke
  # each other's build. flock waits for the other to finish.
  (cd "$REPO" && flock "$target/.vmfork-build.lock" env CARGO_TARGET_DIR="$target" \
      "$VENV/bin/maturin" build --release --locked --jobs "${VMFORK_BUILD_JOBS:-2}" \
      --interpreter "$PY" --out "$out" --quiet) || {
    rm -rf "$out"
    echo "vmfork setup: building the native core failed (output above)" >&2
    exit 1
  }
  "$PY" - "$out" "$REPO/src/vmfork" <<'PLACE'
import glob, os, sys, zipfile
out, dest = sys.argv[1], sys.argv[2]
(wheel,) = glob.glob(os.path.join(out, "*.whl"))
with zipfile.ZipFile(wheel) as z:
    (member,) = [n for n in z.namelist() if n.startswith("vmfork/_core.") and n.endswith(".so")]
    data = z.read(member)
target = os.path.join(dest, os.path.basename(member))
try:
    with open(target, "rb") as f:
        same = f.read() == data
except FileNotFoundError:
    same = False
if not same:
    tmp = f"{target}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.chmod(tmp, 0o755)
    os.replace(tmp, target)
PLACE
  rm -rf "$out"
}

setup_image() {
  log "guest image (kernel from linux-source-6.1, initramfs from Debian packages)"
  "$PY" -m vmfork image build
}

# A `vmfork` command for new shells: a launcher naming this checkout and the venv.
# Rewritten each set-up, so it follows the checkout that ran it last.
setup_launcher() {
  local bin=/usr/local/bin
  if [ "$(id -u)" -ne 0 ]; then bin=$HOME/.local/bin; fi
  mkdir -p "$bin"
  local tmp
  tmp=$(mktemp "$bin/.vmfork.XXXXXX")
  cat > "$tmp" <<LAUNCHER
#!/bin/sh
# The vmfork command, written by $REPO/scripts/lib.sh (setup_launcher).
export VMFORK_CACHE_DIR="\${VMFORK_CACHE_DIR:-$CACHE}"
export PYTHONPATH="$REPO/src\${PYTHONPATH:+:\$PYTHONPATH}"
exec "$VENV/bin/python" -m vmfork "\$@"
LAUNCHER
  chmod 755 "$tmp"
  mv -f "$tmp" "$bin/vmfork"
  case ":$PATH:" in
    *":$bin:"*) ;;
    *) log "vmfork is in $bin, which is not on PATH: add it (export PATH=$bin:\$PATH)" ;;
  esac
}

# The users' images the tests and benchmarks boot (tests/images/*.toml), built natively
# (apt metadata, the package index and npm are reachable here, not in the test host);
# cached by content, so a second set-up only checks them.
TEST_IMAGES=(sci-deb sci-pip node)
setup_test_images() {
  log "test images: ${TEST_IMAGES[*]} (tests/images)"
  local name
  for name in "${TEST_IMAGES[@]}"; do
    "$PY" -m vmfork image build "t-$name" -f "$REPO/tests/images/$name.toml" >/dev/null
  done
  (cd "$REPO" && "$PY" -m tests.images.prepare)
  setup_test_wheels
  setup_forkd_mcp
  setup_e2b_sdk
}

# forkd's MCP server from the registry, unchanged, for the wire-compatibility test
# (tests/e2e/test_forkd_mcp.py drives it with our MCP client against `vmfork serve`).
# A venv of its own: it pins mcp < 2, the project's venv has mcp 2.
FORKD_MCP_VERSION=0.2.1
setup_forkd_mcp() {
  local venv=$CACHE/forkd-mcp-$FORKD_MCP_VERSION
  if [ ! -x "$venv/bin/forkd-mcp" ] || [ ! -f "$venv/.complete" ]; then
    log "forkd-mcp $FORKD_MCP_VERSION (the compatibility test's MCP server)"
    rm -rf "$venv"
    "${VMFORK_PYTHON:-python3}" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "forkd-mcp==$FORKD_MCP_VERSION"
    touch "$venv/.complete"
  fi
}

# E2B's SDKs from the registries, unchanged, for the E2B wire tests
# (tests/unit/test_e2b_wire.py, tests/e2e/test_e2b_sdk.py run E2B programs with them
# against `vmfork serve`): the Python one in a venv of its own (its dependencies are not
# vmfork's), the JavaScript one in a node_modules of its own. Kept equal to
# E2B_SDK_VERSION and E2B_JS_SDK_VERSION in tests/e2b_sdk.py.
E2B_SDK_VERSION=2.63.0
E2B_JS_SDK_VERSION=2.51.0
# E2B's code-interpreter SDKs, each beside the e2b it requires (kept equal to
# E2B_INTERPRETER_VERSION and E2B_JS_INTERPRETER_VERSION in tests/e2b_sdk.py).
E2B_INTERPRETER_VERSION=2.11.5
E2B_JS_INTERPRETER_VERSION=2.8.0
setup_e2b_sdk() {
  local venv=$CACHE/e2b-$E2B_SDK_VERSION
  if [ ! -x "$venv/bin/python" ] || [ ! -f "$venv/.complete" ]; then
    log "e2b $E2B_SDK_VERSION (the E2B wire tests' Python SDK)"
    rm -rf "$venv"
    "${VMFORK_PYTHON:-python3}" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "e2b==$E2B_SDK_VERSION"
    touch "$venv/.complete"
  fi
  local js=$CACHE/e2b-js-$E2B_JS_SDK_VERSION
  if [ ! -f "$js/.complete" ]; then
    log "e2b $E2B_JS_SDK_VERSION (the E2B wire tests' JavaScript SDK)"
    rm -rf "$js"
    mkdir -p "$js"
    echo '{"private": true}' > "$js/package.json"
    (cd "$js" && npm install --no-audit --no-fund --silent "e2b@$E2B_JS_SDK_VERSION")
    touch "$js/.complete"
  fi
  local ci=$CACHE/e2b-code-interpreter-$E2B_INTERPRETER_VERSION
  if [ ! -x "$ci/bin/python" ] || [ ! -f "$ci/.complete" ]; then
    log "e2b-code-interpreter $E2B_INTERPRETER_VERSION (the E2B code-interpreter tests)"
    rm -rf "$ci"
    "${VMFORK_PYTHON:-python3}" -m venv "$ci"
    "$ci/bin/python" -m pip install -q --disable-pip-version-check \
      "e2b==$E2B_SDK_VERSION" "e2b-code-interpreter==$E2B_INTERPRETER_VERSION"
    touch "$ci/.complete"
  fi
  local cijs=$CACHE/e2b-code-interpreter-js-$E2B_JS_INTERPRETER_VERSION
  if [ ! -f "$cijs/.complete" ]; then
    log "@e2b/code-interpreter $E2B_JS_INTERPRETER_VERSION (the E2B code-interpreter tests)"
    rm -rf "$cijs"
    mkdir -p "$cijs"
    echo '{"private": true}' > "$cijs/package.json"
    (cd "$cijs" && npm install --no-audit --no-fund --silent "e2b@$E2B_JS_SDK_VERSION" \
      "@e2b/code-interpreter@$E2B_JS_INTERPRETER_VERSION")
    touch "$cijs/.complete"
  fi
}

# The wheels the pip-chain tests install in guests from a package index on the host
# (tests/pip_index.py): pinned, for the guest's CPython 3.11 on x86-64, fetched here
# once (the test host has no network).
setup_test_wheels() {
  local dir=$CACHE/test-assets/wheels
  local wheels
  wheels=$(cd "$REPO" && "$PY" -c 'from tests.pip_index import WHEELS; print(" ".join(WHEELS))')
  local stamp=$dir/.complete
  if [ "$(cat "$stamp" 2>/dev/null)" != "$wheels" ]; then
    log "test wheels: $wheels"
    mkdir -p "$dir"
    # shellcheck disable=SC2086 # one argument per requirement
    "$PY" -m pip download -q --disable-pip-version-check --only-binary=:all: --no-deps \
      --python-version 3.11 --implementation cp --abi cp311 \
      --platform manylinux_2_17_x86_64 -d "$dir" $wheels
    echo "$wheels" > "$stamp"
  fi
}

# The dashboard's browser test (tests/ui): Debian's chromium and a font to render with,
# and playwright-core from npm (tests/ui/package-lock.json) to drive it. Test-only: the
# demo's set-up does not need a browser.
# cargo-fuzz, for the native core's libFuzzer targets (scripts/fuzz, a tier of
# scripts/test): built once from crates.io into the cache, pinned, with its own target
# directory so the module's build is not invalidated. The targets need a nightly
# toolchain (libFuzzer's instrumentation); without one scripts/fuzz says so.
CARGO_FUZZ_VERSION=0.13.2
CARGO_TOOLS=$CACHE/cargo-tools
setup_fuzz() {
  if ! command -v cargo >/dev/null && [ -x "$HOME/.cargo/bin/cargo" ]; then
    export PATH=$HOME/.cargo/bin:$PATH
  fi
  if [ "$("$CARGO_TOOLS/bin/cargo-fuzz" --version 2>/dev/null)" = "cargo-fuzz $CARGO_FUZZ_VERSION" ]; then
    return
  fi
  log "cargo-fuzz $CARGO_FUZZ_VERSION (native fuzz targets)"
  CARGO_TARGET_DIR=$CACHE/cargo-target-tools cargo install cargo-fuzz \
      --version "$CARGO_FUZZ_VERSION" --locked --root "$CARGO_TOOLS" \
      --jobs "${VMFORK_BUILD_JOBS:-2}" --quiet || {
    echo "vmfork setup: building cargo-fuzz failed (output above)" >&2
    exit 1
  }
}

UI_DEBIAN_PACKAGES=(chromium fonts-dejavu-core)

setup_ui() {
  install_debian_packages "${UI_DEBIAN_PACKAGES[@]}"
  local dir=$REPO/tests/ui lock_hash stamp=$REPO/tests/ui/node_modules/.vmfork-lock-sha256
  lock_hash=$(sha256sum "$dir/package-lock.json" | cut -c1-64)
  if [ "$(cat "$stamp" 2>/dev/null)" != "$lock_hash" ]; then
    log "dashboard test: npm ci (playwright-core)"
    (cd "$dir" && npm ci --no-audit --no-fund --loglevel=error --cache "$CACHE/npm")
    echo "$lock_hash" > "$stamp"
  fi
}

setup_typescript() {
  local sdk=$REPO/sdk/typescript
  if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    echo "vmfork setup: the TypeScript SDK needs Node.js 20+ and npm on PATH" >&2
    exit 1
  fi
  if [ "$(node -p 'process.versions.node.split(".")[0]')" -lt 20 ]; then
    echo "vmfork setup: the TypeScript SDK needs Node.js 20+, found $(node --version)" >&2
    exit 1
  fi
  # npm ci only when package-lock.json changed since the last install.
  local lock_hash stamp=$sdk/node_modules/.vmfork-lock-sha256
  lock_hash=$(sha256sum "$sdk/package-lock.json" | cut -c1-64)
  if [ "$(cat "$stamp" 2>/dev/null)" != "$lock_hash" ]; then
    log "TypeScript SDK: npm ci"
    (cd "$sdk" && npm ci --no-audit --no-fund --loglevel=error --cache "$CACHE/npm")
    echo "$lock_hash" > "$stamp"
  fi
  log "TypeScript SDK: tsc"
  (cd "$sdk" && npx --no-install tsc -p tsconfig.json && npx --no-install tsc -p tsconfig.test.json)
}

setup_all() {
  setup_debian
  setup_python
  setup_native
  setup_image
  setup_launcher
  setup_typescript
}
