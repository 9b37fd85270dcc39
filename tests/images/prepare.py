"""Build the test images that need generated inputs (run by the set-up, natively).

``t-big``: the default image plus 1 GiB of incompressible data at ``/data/big.bin``
(the data is made once from a fixed seed, so its image's content key is stable
from run to run and the build is cached). It shows that a parent boots a large
image without holding it in guest RAM.

``t-oci-python`` and ``t-oci-node``: OCI images made here from Debian packages (no
container registry is reachable from these machines), written as OCI image layouts
(``tests/oci_support.py``) once, then imported with ``vmfork image import``: one whose
own Python runs the agent, with ``Env``, ``WorkingDir`` and ``User`` set, and one with
Node.js and no Python at all, where the agent runs on the bundled interpreter.
"""

from __future__ import annotations

import random
import shutil
import sys
import tempfile
from pathlib import Path

from tests.oci_support import make_oci_layout
from vmfork.image import debian, initramfs
from vmfork.image.builder import build, import_oci
from vmfork.image.spec import CopySpec, ImageSpec
from vmfork.paths import cache_dir

OCI_PYTHON_ENV = ["PATH=/usr/local/bin:/usr/bin:/bin", "APP_MODE=oci", "LANG=C.UTF-8"]

BIG_BYTES = 1 << 30
SEED = 13


def big_file() -> Path:
    path = cache_dir() / "test-assets" / "big-1g.bin"
    if path.is_file() and path.stat().st_size == BIG_BYTES:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    rng = random.Random(SEED)
    with open(tmp, "wb") as f:
        f.writelines(rng.randbytes(1 << 24) for _ in range(BIG_BYTES >> 24))
    tmp.rename(path)
    return path


def _layout(name: str, packages: list[str], **config: object) -> str:
    """An OCI layout of the packages' closure (made once; later runs reuse it, so the
    import's manifest digest, and with it the image's key, stays the same)."""
    out = cache_dir() / "test-assets" / f"oci-{name}"
    ref = f"oci:{out}:latest"
    if (out / "index.json").is_file():
        return ref
    tree = Path(tempfile.mkdtemp(prefix=f"oci-{name}-"))
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        pins = debian.resolve_extra_packages(packages, present=())
        debian.extract(debian.download(pins, cache_dir() / "debs"), tree)
        initramfs.install_busybox_links(tree)
        initramfs.install_base_files(tree)
        (tree / "srv").mkdir(exist_ok=True)
        make_oci_layout(tree, staging, "latest", **config)  # type: ignore[arg-type]
        staging.rename(out)
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    return ref


def main() -> int:
    data = big_file()
    # Uncompressed: the data is incompressible, and lz4hc spent minutes of the set-up on it.
    image = build("t-big", ImageSpec(copy=(CopySpec(data, "/data/big.bin"),),
                                     disk_format="erofs-plain").validate())
    print(f"t-big: {image.disk_size >> 20} MiB disk", file=sys.stderr)
    python = _layout("python", ["busybox-static", "python3.11-minimal", "libpython3.11-stdlib"],
                     env=OCI_PYTHON_ENV, workdir="/srv", user="nobody")
    image = import_oci("t-oci-python", python)
    print(f"t-oci-python: agent on {image.agent_python}", file=sys.stderr)
    node = _layout("node", ["busybox-static", "nodejs"], env=["PATH=/usr/bin:/bin"])
    image = import_oci("t-oci-node", node)
    print(f"t-oci-node: agent on {image.agent_python}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
