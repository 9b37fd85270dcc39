"""Pulling from a registry over the OCI distribution API (v2), with its auth.

What a pull needs of the API is small: ``GET /v2/<repo>/manifests/<tag|digest>``
with an ``Accept`` list (manifest negotiation: OCI index and manifest, Docker
manifest list and schema 2) and ``GET /v2/<repo>/blobs/<digest>``, which often
redirects to storage elsewhere. Auth is what registries do:

1. ask anonymously (or with the token this client already holds);
2. on 401 read ``WWW-Authenticate``. ``Bearer realm=…,service=…,scope=…``: ask
   the realm for a token (with Basic credentials when we have some: a private
   repository; anonymously otherwise: a public one) and retry with it.
   ``Basic``: retry with the credentials;
3. a second 401 or a 403 is the credentials' fault, said so.

Credentials come from the Docker config file (``$DOCKER_CONFIG/config.json`` or
``~/.docker/config.json``; ``auths.<host>.auth`` is base64 ``user:pass``), or
the file the caller names, or the credential helpers it names (``credHelpers``
per host, ``credsStore`` for the rest), run as Docker runs them: ``docker-credential-
<name> get`` on ``PATH``, the server on stdin, ``{Username, Secret}`` on stdout.

Why the stdlib (``http.client``) and not httpx: a pull makes a handful of
requests, and what matters is control we would have to configure anyway: a
timeout on every socket operation plus a deadline per document, a byte cap on
every body (a manifest is a few MiB at most, a blob exactly its descriptor's
size), and redirects that drop ``Authorization`` when they leave the registry's
host (storage back ends reject it, and it must not leak). That is a few lines
over ``http.client``, and vmfork gains no dependency.

HTTPS by default (the system's CA store); plain HTTP only for a loopback
registry (``localhost``, ``127.0.0.0/8``, ``[::1]``) or with ``insecure=True``.
Every blob is streamed to a temporary file in the cache and checked against its
digest and size before it is renamed to ``<cache>/oci/blobs/sha256/<hex>``;
a blob found there was checked when it entered and is trusted (DESIGN.md,
decision 5).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.client
import ipaddress
import json
import os
import re
import select
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Self

from vmfork.image.errors import ImageBuildError
from vmfork.paths import cache_dir

SOCKET_TIMEOUT = 30.0  # seconds, for connect and for each read
DOCUMENT_DEADLINE = 120.0  # seconds for a whole manifest, token or error body
TOKEN_CAP = 1 << 20
ERROR_BODY_CAP = 64 << 10
MAX_REDIRECTS = 5

MANIFEST_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)

_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REPO = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT})*")
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_HOST = re.compile(rf"(?:{_LABEL}(?:\.{_LABEL})*|\[[0-9A-Fa-f:.]+\])(?::[0-9]{{1,5}})?")
_CHALLENGE_PARAM = re.compile(r'([A-Za-z_]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^,\s]*)')

# Docker Hub's names: docker.io is what people write, this is where its API is,
# and its one-component repositories live under library/.
_HUB_NAMES = ("docker.io", "index.docker.io", "registry-1.docker.io")
_HUB_API = "registry-1.docker.io"


class RegistryError(ImageBuildError):
    """A registry refused or failed a request; ``host`` and ``status`` say which."""

    def __init__(self, host: str, status: int | None, message: str) -> None:
        super().__init__("oci-pull", message)
        self.host = host
        self.status = status


@dataclass(frozen=True)
class RegistryRef:
    """``HOST[:PORT]/REPO[:TAG][@sha256:HEX]``; ``reference`` is what to ask for."""

    host: str  # as written
    repository: str
    tag: str | None
    digest: str | None

    @property
    def reference(self) -> str:
        return self.digest or self.tag or "latest"

    @property
    def api_host(self) -> str:
        return _HUB_API if self.host in _HUB_NAMES else self.host

    def __str__(self) -> str:
        return (f"{self.host}/{self.repository}" + (f":{self.tag}" if self.tag else "")
                + (f"@{self.digest}" if self.digest else ""))


def parse_registry_ref(ref: str) -> RegistryRef:
    """Parse a registry reference; ``docker://`` (skopeo's spelling) may lead."""
    text = ref.removeprefix("docker://")
    name, at, digest = text.partition("@")
    if at:
        if digest.startswith("sha256:") and not _DIGEST.fullmatch(digest):
            raise ImageBuildError("oci-ref", f"{ref!r}: a sha256 digest is 64 lowercase hex "
                                  "digits")
        if not _DIGEST.fullmatch(digest):
            raise ImageBuildError("oci-ref", f"{ref!r}: only sha256 digests are supported")
    host, slash, rest = name.partition("/")
    looks_like_host = "." in host or ":" in host or host == "localhost" or host.startswith("[")
    if not slash or not looks_like_host:
        raise ImageBuildError(
            "oci-ref", f"{ref!r} names no registry host: write HOST[:PORT]/REPO[:TAG] (for "
            "example docker.io/library/debian:12), or oci:DIR, oci-archive:TAR or "
            "docker-archive:TAR for local images")
    port = host.rpartition("]")[2].rpartition(":")[2] if ":" in host.rpartition("]")[2] else ""
    if not _HOST.fullmatch(host) or (port and not 0 < int(port) < 65536):
        raise ImageBuildError("oci-ref", f"{ref!r}: {host!r} is not a valid registry host")
    # A tag follows the last ':' only when no '/' comes after it.
    repo, colon, tag = rest.rpartition(":") if ":" in rest.rsplit("/", 1)[-1] else (rest, "", "")
    if colon and not _TAG.fullmatch(tag):
        raise ImageBuildError("oci-ref", f"{ref!r}: {tag!r} is not a valid tag (letters, "
                              "digits, '_', '.', '-'; at most 128)")
    if not _REPO.fullmatch(repo):
        raise ImageBuildError("oci-ref", f"{ref!r}: {repo!r} is not a valid repository name "
                              "(lowercase letters, digits and separators, '/' between parts)")
    if host in _HUB_NAMES and "/" not in repo:
        repo = "library/" + repo
    return RegistryRef(host=host, repository=repo, tag=tag or None, digest=digest or None)


def normalized_name(name: str) -> str:
    """``NAME[:TAG]`` as Docker expands it: a name without a registry host is Docker
    Hub's (``busybox:1`` is ``docker.io/library/busybox:1``). For matching a
    docker-archive's ``RepoTags``, which tools write in either form."""
    first, slash, _ = name.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        return name
    return "docker.io/" + (name if slash else "library/" + name)


def _is_loopback(hostname: str) -> bool:
    if hostname == "localhost":
        return True
    try:
        return ipaddress.ip_address(hostname).is_loopback
    except ValueError:
        return False


def docker_config_path() -> Path:
    base = os.environ.get("DOCKER_CONFIG")
    return Path(base) / "config.json" if base else Path.home() / ".docker" / "config.json"


def read_credentials(host: str, auth_file: Path | None) -> tuple[str, str] | None:
    """``(user, password)`` for ``host`` from a Docker config file, or None.

    Docker's order: a credential helper named for the host in ``credHelpers``; then an
    entry in ``auths``; then the ``credsStore`` helper. A named ``auth_file`` must
    exist; the default one may be absent.
    """
    path = auth_file or docker_config_path()
    try:
        config = json.loads(path.read_bytes())
    except FileNotFoundError:
        if auth_file is not None:
            raise ImageBuildError("oci-auth", f"the auth file {path} does not exist") from None
        return None
    except (OSError, ValueError) as err:
        raise ImageBuildError("oci-auth", f"cannot read the auth file {path}: {err}") from None
    if not isinstance(config, dict):
        return None
    wanted = {host} | (set(_HUB_NAMES) if host in _HUB_NAMES else set())
    helpers = config.get("credHelpers")
    if isinstance(helpers, dict):
        for key, name in helpers.items():
            if _config_key_host(key) in wanted and isinstance(name, str):
                return run_credential_helper(name, _helper_server(host), path)
    auths = config.get("auths")
    for key, entry in (auths.items() if isinstance(auths, dict) else ()):
        if _config_key_host(key) not in wanted or not isinstance(entry, dict):
            continue
        if isinstance(entry.get("auth"), str) and entry["auth"]:
            try:
                user, colon, password = base64.b64decode(entry["auth"]).decode().partition(":")
            except (ValueError, UnicodeDecodeError):
                raise ImageBuildError("oci-auth", f"{path}: auths.{key}.auth is not base64 "
                                      "of user:password") from None
            if colon:
                return user, password
        if isinstance(entry.get("username"), str) and isinstance(entry.get("password"), str):
            return entry["username"], entry["password"]
    store = config.get("credsStore")
    if isinstance(store, str) and store:
        return run_credential_helper(store, _helper_server(host), path)
    return None


def _config_key_host(key: object) -> str:
    """Keys are "host[:port]" or URLs ("https://index.docker.io/v1/"), as Docker writes them."""
    return str(key).split("://", 1)[-1].split("/", 1)[0]


def _helper_server(host: str) -> str:
    """The server name a helper stores credentials under: Docker Hub's v1 URL, else the
    host as written (``docker login HOST`` stores ``HOST``)."""
    return "https://index.docker.io/v1/" if host in _HUB_NAMES else host


_HELPER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
HELPER_TIMEOUT = 30.0  # seconds: a helper that asks a keychain or a cloud's metadata service
HELPER_OUTPUT_CAP = 64 << 10
# What Docker's helpers print (exit 1) when they hold nothing for the server.
_HELPER_NOT_FOUND = "credentials not found"


def run_credential_helper(name: str, server: str, config: Path) -> tuple[str, str] | None:
    """``docker-credential-<name> get`` for ``server``: its ``(Username, Secret)``, None if
    it holds nothing for the server; any other failure is an ``oci-auth`` error naming
    the helper and what it said. Its output is read up to a cap, under a deadline."""
    if not _HELPER_NAME.fullmatch(name):
        raise ImageBuildError("oci-auth", f"{config}: {name!r} is not a credential helper name "
                              "(letters, digits, '.', '_', '-')")
    program = shutil.which(f"docker-credential-{name}")
    if program is None:
        raise ImageBuildError("oci-auth", f"{config} names the credential helper {name!r}, but "
                              f"docker-credential-{name} is not on PATH")
    try:
        helper = subprocess.Popen([program, "get"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
    except OSError as err:
        raise ImageBuildError("oci-auth", f"cannot run docker-credential-{name}: {err}") from None
    assert helper.stdin is not None and helper.stdout is not None
    try:
        try:
            helper.stdin.write(server.encode() + b"\n")
            helper.stdin.close()
        except BrokenPipeError:
            pass  # it exited without reading; its status says why
        output = _read_bounded(helper.stdout, HELPER_OUTPUT_CAP, time.monotonic() + HELPER_TIMEOUT)
        if output is None:
            raise ImageBuildError("oci-auth", f"docker-credential-{name} get did not answer "
                                  f"within {HELPER_TIMEOUT:.0f} s with at most "
                                  f"{HELPER_OUTPUT_CAP} bytes")
        status = helper.wait(timeout=HELPER_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise ImageBuildError("oci-auth", f"docker-credential-{name} get did not exit within "
                              f"{HELPER_TIMEOUT:.0f} s") from None
    finally:
        if helper.poll() is None:
            # Its whole session: a helper's own children (a shell's ``sleep``) go too.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(helper.pid, signal.SIGKILL)
            helper.wait()
        helper.stdout.close()
    said = output.decode("utf-8", "replace").strip()
    if status != 0:
        if _HELPER_NOT_FOUND in said.lower():
            return None
        raise ImageBuildError("oci-auth", f"docker-credential-{name} get failed "
                              f"(exit {status}): {said[:300]}")
    try:
        answer = json.loads(output)
        user, secret = answer["Username"], answer["Secret"]
    except (ValueError, KeyError, TypeError):
        raise ImageBuildError("oci-auth", f"docker-credential-{name} get answered something "
                              "other than {Username, Secret} JSON") from None
    if not isinstance(user, str) or not isinstance(secret, str):
        raise ImageBuildError("oci-auth", f"docker-credential-{name} get: Username and Secret "
                              "must be strings")
    if user == "<token>":
        # An identity token: an OAuth2 refresh token for the registry's token service.
        raise ImageBuildError("oci-auth", f"docker-credential-{name} holds an identity token "
                              f"for {server}; vmfork needs a user name and password (or an "
                              "access token as the password)")
    return user, secret


def _read_bounded(stream: IO[bytes], cap: int, deadline: float) -> bytes | None:
    """All of ``stream`` up to EOF, or None if it passes ``cap`` bytes or ``deadline``."""
    chunks: list[bytes] = []
    size = 0
    fd = stream.fileno()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            return None
        chunk = os.read(fd, 4096)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > cap:
            return None
        chunks.append(chunk)


def _basic(creds: tuple[str, str]) -> str:
    return "Basic " + base64.b64encode(f"{creds[0]}:{creds[1]}".encode()).decode()


def _parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    scheme, _, params = header.strip().partition(" ")
    found = {k.lower(): (v[1:-1].replace('\\"', '"') if v.startswith('"') else v)
             for k, v in _CHALLENGE_PARAM.findall(params)}
    return scheme.lower(), found


class _Response:
    """An open response and its connection, closed together."""

    def __init__(self, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse,
                 url: str) -> None:
        self.conn = conn
        self.resp = resp
        self.url = url
        self.status = resp.status

    def header(self, name: str) -> str | None:
        return self.resp.getheader(name)

    def close(self) -> None:
        self.resp.close()
        self.conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RegistryClient:
    """One repository on one registry; holds the bearer token between requests."""

    def __init__(self, ref: RegistryRef, *, auth_file: Path | None = None,
                 insecure: bool = False, actions: str = "pull") -> None:
        self.ref = ref
        self.insecure = insecure
        self.actions = actions  # the token scope asked for when a challenge names none
        self.last_resumes = 0   # how often the last resume_blob_to continued a download
        host = urllib.parse.urlsplit("//" + ref.api_host).hostname or ref.api_host
        self.scheme = "http" if insecure or _is_loopback(host) else "https"
        self.base = f"{self.scheme}://{ref.api_host}/v2/{ref.repository}"
        self._auth_file = auth_file
        self._creds: tuple[str, str] | None = None
        self._creds_read = False
        self._authorization: str | None = None
        self._ssl = ssl.create_default_context()

    def _credentials(self) -> tuple[str, str] | None:
        if not self._creds_read:
            self._creds = read_credentials(self.ref.host, self._auth_file)
            self._creds_read = True
        return self._creds

    def _fail(self, status: int | None, message: str) -> RegistryError:
        return RegistryError(self.ref.host, status, f"{self.ref.host}: {message}")

    # HTTP ------------------------------------------------------------------

    def _open(self, url: str, headers: dict[str, str], method: str = "GET",
              body: bytes | None = None) -> _Response:
        """One request, following redirects (of GET and HEAD only); ``Authorization``
        stays on the first host."""
        first_host = urllib.parse.urlsplit(url).netloc
        for _ in range(MAX_REDIRECTS + 1):
            parts = urllib.parse.urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise self._fail(None, f"the registry sent us to {url!r}, not an http(s) URL")
            if parts.scheme == "http" and self.scheme == "https" and not self.insecure:
                raise self._fail(None, f"the registry redirected to plain http ({parts.netloc}); "
                                 "pass insecure=True only if you trust the network")
            conn: http.client.HTTPConnection
            if parts.scheme == "https":
                conn = http.client.HTTPSConnection(parts.hostname, parts.port,
                                                   timeout=SOCKET_TIMEOUT, context=self._ssl)
            else:
                conn = http.client.HTTPConnection(parts.hostname, parts.port,
                                                  timeout=SOCKET_TIMEOUT)
            sent = dict(headers)
            if parts.netloc != first_host:
                sent.pop("Authorization", None)
            sent.setdefault("User-Agent", "vmfork")
            path = parts.path + (f"?{parts.query}" if parts.query else "")
            if body is not None:
                sent["Content-Length"] = str(len(body))
            try:
                conn.request(method, path or "/", body=body, headers=sent)
                resp = conn.getresponse()
            except (OSError, http.client.HTTPException) as err:
                conn.close()
                raise self._fail(None, f"{method} {parts.scheme}://{parts.netloc}{parts.path} "
                                 f"failed: {_describe(err)}") from err
            if resp.status in (301, 302, 303, 307, 308) and method in ("GET", "HEAD"):
                location = resp.getheader("Location")
                resp.close()
                conn.close()
                if not location:
                    raise self._fail(resp.status, "a redirect without a Location")
                url = urllib.parse.urljoin(url, location)
                continue
            return _Response(conn, resp, url)
        raise self._fail(None, f"more than {MAX_REDIRECTS} redirects from {first_host}")

    def _get(self, path: str, headers: dict[str, str]) -> _Response:
        """GET ``<base>/<path>``, authenticating when the registry asks."""
        return self.request("GET", path, headers)

    def request(self, method: str, path: str, headers: dict[str, str] | None = None,
                body: bytes | None = None) -> _Response:
        """``method`` on ``<base>/<path>`` (or on an absolute URL of the registry's own
        host, as upload ``Location``s are), authenticating when the registry asks: a
        token for pulling does not cover pushing, so a push's first write is answered
        with a new challenge naming the wider scope, and a new token is fetched."""
        url = path if "://" in path else f"{self.base}/{path}"
        if urllib.parse.urlsplit(url).netloc != self.ref.api_host:
            raise self._fail(None, f"the registry named {url!r}, which is not on "
                             f"{self.ref.api_host}; refusing to send it anything")
        for attempt in range(2):
            sent = dict(headers or {})
            if self._authorization:
                sent["Authorization"] = self._authorization
            r = self._open(url, sent, method, body)
            if r.status != 401 or attempt == 1:
                return r
            challenge = r.header("WWW-Authenticate") or ""
            _read_capped(r, ERROR_BODY_CAP, "an error body", self)
            r.close()
            self._authenticate(challenge)
        raise AssertionError("unreachable")

    def _authenticate(self, challenge: str) -> None:
        """Set ``Authorization`` for the retry the 401's ``challenge`` asks for."""
        scheme, params = _parse_challenge(challenge)
        creds = self._credentials()
        if scheme == "basic":
            if creds is None:
                raise self._fail(401, f"needs a user name and password: add them to "
                                 f"{self._auth_file or docker_config_path()} (auths.{self.ref.host}"
                                 ".auth = base64 of user:password, as docker login writes)")
            self._authorization = _basic(creds)
            return
        if scheme != "bearer" or "realm" not in params:
            raise self._fail(401, f"asks for auth we do not speak: {challenge!r}")
        realm = urllib.parse.urlsplit(params["realm"])
        if realm.scheme not in ("http", "https") or not realm.hostname:
            raise self._fail(401, f"its token realm {params['realm']!r} is not an http(s) URL")
        if (realm.scheme == "http" and creds is not None and not self.insecure
                and not _is_loopback(realm.hostname)):
            raise self._fail(401, f"its token realm {params['realm']} is plain http: refusing "
                             "to send credentials there (insecure=True overrides)")
        query = []
        if "service" in params:
            query.append(("service", params["service"]))
        scope = params.get("scope") or f"repository:{self.ref.repository}:{self.actions}"
        query += [("scope", s) for s in scope.split(" ") if s]
        url = params["realm"] + ("&" if realm.query else "?") + urllib.parse.urlencode(query)
        headers = {"Authorization": _basic(creds)} if creds else {}
        with self._open(url, headers) as r:
            body = _read_capped(r, TOKEN_CAP, "a token response", self)
            if r.status in (401, 403):
                who = (f"the credentials for {self.ref.host} in "
                       f"{self._auth_file or docker_config_path()}" if creds else
                       "anonymous access")
                raise self._fail(r.status, f"its token service refused {who} to "
                                 f"{self.ref.repository} (docker login, or check the name)")
            if r.status != 200:
                raise self._fail(r.status, f"its token service answered {r.status}: "
                                 f"{_error_text(body)}")
        try:
            doc = json.loads(body)
            token = doc.get("token") or doc.get("access_token")
        except (ValueError, AttributeError):
            token = None
        if not isinstance(token, str) or not token:
            raise self._fail(None, "its token service sent no token")
        self._authorization = f"Bearer {token}"

    def _check(self, r: _Response, what: str) -> None:
        if r.status == 200:
            return
        body = _read_capped(r, ERROR_BODY_CAP, "an error body", self)
        detail = _error_text(body)
        if r.status == 404:
            raise self._fail(404, f"{what} not found in {self.ref.repository} ({detail}): check "
                             "the name, tag or digest")
        if r.status in (401, 403):
            source = self._auth_file or docker_config_path()
            if self._credentials() is None:
                raise self._fail(r.status, f"no anonymous access to {what} in "
                                 f"{self.ref.repository} ({detail}): add credentials for "
                                 f"{self.ref.host} to {source}")
            raise self._fail(r.status, f"refused the credentials for {self.ref.host} in {source} "
                             f"for {what} in {self.ref.repository} ({detail})")
        if r.status == 429:
            raise self._fail(429, "rate-limited the pull (429 Too Many Requests): wait, or log in")
        raise self._fail(r.status, f"answered {r.status} for {what}: {detail}")

    # The API ---------------------------------------------------------------

    def manifest(self, reference: str, cap: int) -> tuple[bytes, str]:
        """The manifest (or index) ``reference`` names: its bytes and media type."""
        with self._get(f"manifests/{reference}", {"Accept": ", ".join(MANIFEST_TYPES)}) as r:
            self._check(r, f"manifest {reference}")
            body = _read_capped(r, cap, f"manifest {reference}", self)
            media_type = (r.header("Content-Type") or "").split(";")[0].strip()
        return body, media_type

    def blob_to(self, digest: str, size: int, out: IO[bytes],
                progress: Callable[[int], None] | None = None) -> str:
        """Stream blob ``digest`` into the binary file ``out``; return its sha256 hex.

        More bytes than ``size`` is refused as soon as they arrive.
        """
        h = hashlib.sha256()
        done = 0
        with self._get(f"blobs/{digest}", {}) as r:
            self._check(r, f"blob {digest}")
            length = r.header("Content-Length")
            if length is not None and length.isdigit() and int(length) != size:
                raise self._fail(None, f"blob {digest} is {length} bytes, but its descriptor says "
                                 f"{size}")
            while True:
                try:
                    chunk = r.resp.read(1 << 20)
                except (OSError, http.client.HTTPException) as err:
                    raise self._fail(None, f"blob {digest}: the download broke after {done} "
                                     f"bytes ({_describe(err)})") from err
                if not chunk:
                    break
                done += len(chunk)
                if done > size:
                    raise self._fail(None, f"blob {digest} is larger than its descriptor's "
                                     f"{size} bytes")
                h.update(chunk)
                out.write(chunk)
                if progress is not None:
                    progress(done)
        if done != size:
            raise self._fail(None, f"blob {digest} ended after {done} of {size} bytes")
        return h.hexdigest()


    # Pushing, and resumable pulls (snapshots: vmfork.store.distribution) ---------

    def has_blob(self, digest: str) -> int | None:
        """The size of blob ``digest`` if the repository has it (HEAD), else None."""
        with self.request("HEAD", f"blobs/{digest}") as r:
            if r.status == 404:
                return None
            self._check(r, f"blob {digest}")
            length = r.header("Content-Length")
            return int(length) if length is not None and length.isdigit() else 0

    def mount_blob(self, digest: str, source_repository: str) -> str | None:
        """Ask for ``digest`` to be mounted from another repository of this registry.
        True mount: None. A registry that cannot (or a blob that is not there) starts
        an ordinary upload instead (202): its URL is returned, for ``upload_blob``."""
        query = urllib.parse.urlencode({"mount": digest, "from": source_repository})
        with self.request("POST", f"blobs/uploads/?{query}", body=b"") as r:
            if r.status == 201:
                _read_capped(r, ERROR_BODY_CAP, "a mount answer", self)
                return None
            return self._upload_location(r, "a mount")

    def start_upload(self) -> str:
        with self.request("POST", "blobs/uploads/", body=b"") as r:
            return self._upload_location(r, "an upload")

    def _upload_location(self, r: _Response, what: str) -> str:
        if r.status != 202:
            self._check(r, what)        # raises: 200 is no answer to a POST either
            raise self._fail(r.status, f"answered {r.status} to {what} (wanted 202)")
        _read_capped(r, ERROR_BODY_CAP, "an upload answer", self)
        location = r.header("Location")
        if not location:
            raise self._fail(r.status, f"accepted {what} but named no upload Location")
        return urllib.parse.urljoin(r.url, location)

    def upload_blob(self, location: str, source: IO[bytes], size: int, digest: str,
                    chunk_bytes: int, progress: Callable[[int], None] | None = None) -> None:
        """Upload ``size`` bytes of ``source`` in chunks: ``PATCH`` each with its
        ``Content-Range`` (the registry answers with the next ``Location``), then
        ``PUT ?digest=`` to close the upload; the registry checks the digest."""
        done = 0
        while done < size:
            chunk = source.read(min(chunk_bytes, size - done))
            if not chunk:
                raise self._fail(None, f"the local file for blob {digest} ended at {done} of "
                                 f"{size} bytes")
            headers = {"Content-Type": "application/octet-stream",
                       "Content-Range": f"{done}-{done + len(chunk) - 1}"}
            with self.request("PATCH", location, headers, chunk) as r:
                if r.status != 202:
                    self._check(r, f"a chunk of blob {digest}")
                    raise self._fail(r.status, f"answered {r.status} to a chunk of {digest}")
                _read_capped(r, ERROR_BODY_CAP, "an upload answer", self)
                location = urllib.parse.urljoin(r.url, r.header("Location") or location)
            done += len(chunk)
            if progress is not None:
                progress(done)
        joiner = "&" if urllib.parse.urlsplit(location).query else "?"
        url = location + joiner + urllib.parse.urlencode({"digest": digest})
        with self.request("PUT", url, {"Content-Type": "application/octet-stream"}, b"") as r:
            if r.status != 201:
                self._check(r, f"the end of blob {digest}'s upload")
                raise self._fail(r.status, f"answered {r.status} closing blob {digest}")
            _read_capped(r, ERROR_BODY_CAP, "an upload answer", self)

    def put_manifest(self, reference: str, body: bytes, media_type: str) -> str:
        """``PUT`` a manifest under a tag (or its digest); returns its digest."""
        with self.request("PUT", f"manifests/{reference}", {"Content-Type": media_type},
                          body) as r:
            if r.status not in (200, 201):
                self._check(r, f"manifest {reference}")
                raise self._fail(r.status, f"answered {r.status} to manifest {reference}")
            _read_capped(r, ERROR_BODY_CAP, "a manifest answer", self)
        return "sha256:" + hashlib.sha256(body).hexdigest()

    def resume_blob_to(self, digest: str, size: int, out: IO[bytes], *, retries: int = 5,
                       progress: Callable[[int], None] | None = None) -> str:
        """Like ``blob_to``, but a download that breaks is continued where it stopped
        (``Range: bytes=N-``, answered ``206``), up to ``retries`` times; a registry
        that ignores the range (``200``) is read again from the start. Returns the
        sha256 hex of the whole blob. ``out`` must be empty, opened for writing."""
        h = hashlib.sha256()
        done = 0
        self.last_resumes = 0
        for attempt in range(retries + 1):
            headers = {"Range": f"bytes={done}-"} if done else {}
            self.last_resumes += bool(done)
            try:
                with self._get(f"blobs/{digest}", headers) as r:
                    if done and r.status == 206:
                        span = (r.header("Content-Range") or "").removeprefix("bytes ")
                        if not span.startswith(f"{done}-"):
                            raise self._fail(206, f"blob {digest}: asked for bytes from {done}"
                                             f", the registry sent {span!r}")
                    elif r.status == 200:
                        if done:
                            out.seek(0)
                            out.truncate()
                            h, done = hashlib.sha256(), 0
                    else:
                        self._check(r, f"blob {digest}")
                    while True:
                        chunk = r.resp.read(1 << 20)
                        if not chunk:
                            break
                        done += len(chunk)
                        if done > size:
                            raise self._fail(None, f"blob {digest} is larger than its "
                                             f"descriptor's {size} bytes")
                        h.update(chunk)
                        out.write(chunk)
                        if progress is not None:
                            progress(done)
            except (OSError, http.client.HTTPException) as err:
                if attempt == retries:
                    raise self._fail(None, f"blob {digest}: the download broke after {done} "
                                     f"bytes, {retries} times resumed ({_describe(err)})"
                                     ) from err
                continue
            if done == size:
                return h.hexdigest()
            # The body ended short (the connection closed early): continue from here.
        raise self._fail(None, f"blob {digest}: the download broke after {done} of {size} "
                         f"bytes, {retries} times resumed")


def _describe(err: BaseException) -> str:
    if isinstance(err, socket.timeout):
        return f"timed out after {SOCKET_TIMEOUT:.0f} s"
    if isinstance(err, ssl.SSLCertVerificationError):
        return f"{err.verify_message} (a registry with a private CA needs it in the system store)"
    return str(err) or type(err).__name__


def _read_capped(r: _Response, cap: int, what: str, client: RegistryClient) -> bytes:
    """A whole body of at most ``cap`` bytes, read within ``DOCUMENT_DEADLINE``."""
    length = r.header("Content-Length")
    if length is not None and length.isdigit() and int(length) > cap:
        raise client._fail(r.status, f"{what} is {length} bytes, over the cap of {cap}")
    deadline = time.monotonic() + DOCUMENT_DEADLINE
    chunks: list[bytes] = []
    got = 0
    while True:
        try:
            chunk = r.resp.read(min(1 << 16, cap + 1 - got))
        except (OSError, http.client.HTTPException) as err:
            raise client._fail(r.status, f"reading {what} failed: {_describe(err)}") from err
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        got += len(chunk)
        if got > cap:
            raise client._fail(r.status, f"{what} is over the cap of {cap} bytes")
        if time.monotonic() > deadline:
            raise client._fail(r.status, f"{what} took more than {DOCUMENT_DEADLINE:.0f} s")


def _error_text(body: bytes) -> str:
    """The distribution API's ``{"errors": [{"code", "message"}]}``, or the raw text."""
    try:
        errors = json.loads(body)["errors"]
        return "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errors[:5])
    except (ValueError, KeyError, TypeError, AttributeError):
        return body[:300].decode(errors="replace").strip() or "no details"


def blob_cache_dir() -> Path:
    return cache_dir() / "oci" / "blobs" / "sha256"


def cached_blob(client: RegistryClient, digest: str, size: int,
                progress: Callable[[int], None] | None = None) -> Path:
    """The verified local copy of blob ``digest``, downloading it if it is not cached."""
    hexdigest = digest.removeprefix("sha256:")
    final = blob_cache_dir() / hexdigest
    try:
        if final.stat().st_size == size:
            return final
    except FileNotFoundError:
        pass
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=".download-", dir=final.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            got = client.blob_to(digest, size, out, progress)
            if got != hexdigest:
                raise RegistryError(client.ref.host, None, f"{client.ref.host}: blob {digest} "
                                    f"arrived with digest sha256:{got}: a corrupt registry or a "
                                    "tampered connection; it was not used")
            out.flush()
            os.fsync(out.fileno())
        os.rename(tmp_name, final)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise
    return final
