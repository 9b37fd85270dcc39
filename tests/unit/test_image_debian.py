"""Package resolution: the pure parts (closure parsing, allow/deny filter, apt records)."""

from __future__ import annotations

import pytest

from vmfork.image import debian
from vmfork.image.errors import ImageBuildError

CLOSURE = """\
python3.11-minimal
  PreDepends: libc6
  Depends: libpython3.11-minimal
  Depends: zlib1g
libc6
  Depends: libgcc-s1
libgcc-s1
  Depends: gcc-12-base
gcc-12-base
libpython3.11-stdlib
 |Depends: media-types
  Depends: mime-support
  Depends: <perlapi-5.36.0>
media-types
mime-support
  Depends: mailcap
mailcap
<perlapi-5.36.0>
libpython3.11-minimal
zlib1g
busybox-static
"""

RECORDS = """\
Package: busybox-static
Version: 1:1.35.0-4+deb12u1+b1
Installed-Size: 1941
Architecture: amd64
Description: Standalone rescue shell with tons of builtin utilities
 BusyBox combines tiny versions of many common UNIX utilities into a single
 small executable.
Filename: pool/main/b/busybox/busybox-static_1.35.0-4+deb12u1+b1_amd64.deb
Size: 928188
SHA256: 3d3fdbe91d4660c873e14b092c213fe81c1da6362daa236eb25d0171eb108744

Package: media-types
Version: 10.0.0
Architecture: all
Filename: pool/main/m/media-types/media-types_10.0.0_all.deb
Size: 26136
SHA256: aaa46dcb3b39948ae2e0fdb72cfcb2f48c0b59f19785a3da8045c05eb19955dd
"""


def test_closure_lists_packages_not_edges_or_virtuals() -> None:
    names = debian.parse_depends_closure(CLOSURE)
    assert "libc6" in names and "mailcap" in names
    assert not any(n.startswith("<") or ":" in n for n in names)
    assert len(names) == 11


def test_select_keeps_allowed_and_drops_denied() -> None:
    closure = debian.parse_depends_closure(CLOSURE) | set(debian.ROOT_PACKAGES)
    selected = debian.select_packages(closure)
    assert selected == sorted(selected)
    assert "libc6" in selected and "media-types" in selected
    for denied in ("gcc-12-base", "mime-support", "mailcap"):
        assert denied not in selected


def test_unknown_package_stops_the_build_and_names_it() -> None:
    closure = debian.parse_depends_closure(CLOSURE) | {"libsurprise1"}
    with pytest.raises(ImageBuildError, match="libsurprise1") as err:
        debian.select_packages(closure)
    assert err.value.step == "resolve-packages"
    assert "ALLOW" in str(err.value) and "DENY" in str(err.value)


def test_missing_root_package_says_to_update_apt() -> None:
    closure = debian.parse_depends_closure(CLOSURE) - {"busybox-static"}
    with pytest.raises(ImageBuildError, match="busybox-static.*apt-get update"):
        debian.select_packages(closure)


def test_lists_are_consistent() -> None:
    assert not debian.ALLOW.keys() & debian.DENY.keys()
    assert set(debian.ROOT_PACKAGES) <= debian.ALLOW.keys()
    assert all(reason.strip() for reason in [*debian.ALLOW.values(), *debian.DENY.values()])


def test_package_records() -> None:
    records = debian.parse_package_records(RECORDS)
    assert set(records) == {"busybox-static", "media-types"}
    bb = records["busybox-static"]
    assert bb.version == "1:1.35.0-4+deb12u1+b1"
    assert bb.size == 928188
    assert bb.deb_name == "busybox-static_1.35.0-4+deb12u1+b1_amd64.deb"
    assert bb.pin() == (
        "busybox-static=1:1.35.0-4+deb12u1+b1 amd64 "
        "sha256:3d3fdbe91d4660c873e14b092c213fe81c1da6362daa236eb25d0171eb108744"
    )
    assert records["media-types"].architecture == "all"


def test_incomplete_record_is_an_error() -> None:
    broken = RECORDS.replace(
        "SHA256: aaa46dcb3b39948ae2e0fdb72cfcb2f48c0b59f19785a3da8045c05eb19955dd\n", ""
    )
    with pytest.raises(ImageBuildError, match="media-types"):
        debian.parse_package_records(broken)
