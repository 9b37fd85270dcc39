"""Build the test images that need generated inputs (run by the set-up, natively).

``t-big``: the default image plus 1 GiB of incompressible data at ``/data/big.bin``
(the data is made once from a fixed seed, so its image's content key is stable
from run to run and the build is cached). It shows that a parent boots a large
image without holding it in guest RAM.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

from vmfork.image.builder import build
from vmfork.image.spec import CopySpec, ImageSpec
from vmfork.paths import cache_dir

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
        for _ in range(BIG_BYTES >> 24):
            f.write(rng.randbytes(1 << 24))
    tmp.rename(path)
    return path


def main() -> int:
    data = big_file()
    image = build("t-big", ImageSpec(copy=(CopySpec(data, "/data/big.bin"),)).validate())
    print(f"t-big: {image.disk_size >> 20} MiB disk", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
