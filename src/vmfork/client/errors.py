"""The SDK's errors, apart from its HTTP client: the CLI catches them in every command
and must not import httpx (about 0.1 s) for a command that never talks to a daemon."""

from __future__ import annotations

from typing import Any

from vmfork.client.images import ImageInfo


class ControllerError(Exception):
    """The daemon answered with an error (``status`` ≥ 400, ``body`` its decoded JSON or
    text), or could not be reached (``status`` 0)."""

    def __init__(self, status: int, body: Any, url: str) -> None:
        message = body.get("error") if isinstance(body, dict) else body
        super().__init__(f"{status} from {url}: {message}")
        self.status = status
        self.body = body
        self.url = url

    @property
    def message(self) -> str:
        return str(self.body.get("error") if isinstance(self.body, dict) else self.body)


class ImageBuildFailed(ControllerError):
    """``wait_image``: the build or import ended ``failed``; ``info.error`` says why and
    ``info.progress`` shows its last steps."""

    def __init__(self, info: ImageInfo, url: str) -> None:
        super().__init__(422, {"error": info.error or "the image build failed"}, url)
        self.info = info
