"""Errors raised while building or finding a guest image.

They are defined by who must act: ``InvalidImageName`` is the caller's input,
``ImageMissing`` means nothing was built yet (run ``vmfork image build``), and
``ImageBuildError`` is a failed build step, named in ``step`` so the message
says where it broke and what to do about it.
"""

from __future__ import annotations


class ImageError(RuntimeError):
    """Base class for everything ``vmfork.image`` raises on purpose."""


class InvalidImageName(ImageError, ValueError):
    """An image name that could not be used as a file name."""


class ImageMissing(ImageError):
    """The named image has not been built (or its cache entries were removed)."""


class ImageBuildError(ImageError):
    """A build step failed; ``step`` names it and the message says what to do."""

    def __init__(self, step: str, message: str) -> None:
        super().__init__(f"step {step}: {message}")
        self.step = step
