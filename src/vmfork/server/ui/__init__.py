"""The dashboard (issue 18): static files the daemon serves at ``/ui``.

Plain HTML, CSS and one ES module, shipped inside the package and served from it, so
the page needs no CDN, no build step and no network beyond the daemon. The files
carry no data: everything the page shows it fetches from the REST API with the
bearer token the user typed (kept in the tab's ``sessionStorage``, never in a URL),
so the files themselves are served without a token and the API's own checks apply
to every call the page makes.

The Content-Security-Policy allows only this origin's scripts, styles and API
(no inline script, no eval, no framing), so text a guest wrote (a file name, a
command's output, the console) can never run as code even if the page's own
escaping had a hole.
"""

from __future__ import annotations

from importlib import resources

ASSETS: dict[str, str] = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}

HEADERS = {
    "Content-Security-Policy": ("default-src 'none'; script-src 'self'; style-src 'self'; "
                                "connect-src 'self'; img-src 'self' blob: data:; "
                                "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",
}


def asset(name: str) -> tuple[bytes, str] | None:
    """The file's bytes and content type, or None for a name that is not one of ours
    (the set is fixed: a path from the request never reaches the file system)."""
    content_type = ASSETS.get(name)
    if content_type is None:
        return None
    return resources.files(__name__).joinpath(name).read_bytes(), content_type
