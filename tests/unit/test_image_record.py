"""Image names and image records: validation, JSON round trip, find/list behaviour."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from vmfork import image
from vmfork.image import GuestImage, ImageMissing, InvalidImageName


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("VMFORK_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("name", ["default", "a", "A-b_9", "x" * 64])
def test_valid_names(name: str) -> None:
    assert image.validate_name(name) == name


@pytest.mark.parametrize(
    "name", ["", "x" * 65, "../x", "a/b", "a.b", " a", "a\n", "é", ".", "default.json"]
)
def test_invalid_names(name: str) -> None:
    with pytest.raises(InvalidImageName, match="1 to 64"):
        image.validate_name(name)
    with pytest.raises(InvalidImageName):
        image.record_path(name)


def _image(cache: Path, name: str = "default", *, files: bool = True) -> GuestImage:
    kkey, ikey = "a" * 24, "b" * 24
    kernel, initrd = image.kernel_path(kkey, cache), image.initrd_path(ikey, cache)
    if files:
        for path, size in ((kernel, 100), (initrd, 40)):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"\0" * size)
    return GuestImage(
        name=name, kernel=kernel, initrd=initrd, kernel_key=kkey, initramfs_key=ikey,
        cmdline=image.DEFAULT_CMDLINE,
        created=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
        kernel_size=100, initrd_size=40,
    )


def test_record_round_trip(cache: Path) -> None:
    img = _image(cache)
    record = json.loads(json.dumps(img.to_record()))
    assert GuestImage.from_record(record, cache) == img
    assert "kernel" not in record, "records hold keys, not host paths"


def test_write_find_list(cache: Path) -> None:
    img = _image(cache)
    path = image.write_record(img)
    assert path == cache / "images/default.json"
    assert [p.name for p in path.parent.iterdir()] == ["default.json"], "no temp files left"
    assert image.find_image() == img
    image.write_record(_image(cache, "other"))
    (cache / "images/broken.json").write_text("{not json")
    assert [i.name for i in image.list_images()] == ["default", "other"]


def test_find_missing_says_what_to_run(cache: Path) -> None:
    with pytest.raises(ImageMissing, match=r"run `vmfork image build`"):
        image.find_image()
    with pytest.raises(ImageMissing, match=r"`vmfork image build dev`"):
        image.find_image("dev")


def test_find_with_deleted_entries(cache: Path) -> None:
    image.write_record(_image(cache, files=False))
    with pytest.raises(ImageMissing, match="no longer exist.*vmfork image build"):
        image.find_image()


@pytest.mark.parametrize("field,value", [("kernel_key", "../../etc"), ("format", 99),
                                         ("name", "a/b"), ("created", "yesterday")])
def test_tampered_records_are_refused(cache: Path, field: str, value: object) -> None:
    record = _image(cache).to_record()
    record[field] = value
    (cache / "images").mkdir()
    (cache / "images/default.json").write_text(json.dumps(record))
    with pytest.raises(ImageMissing, match="malformed"):
        image.find_image()
