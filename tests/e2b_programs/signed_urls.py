"""An E2B program: the SDK's signed file URLs (``download_url``, ``upload_url``, with
and without ``use_signature_expiration``), fetched with plain HTTP as a browser or
another service would, plus the ways a URL can be wrong. Run by the tests with the
SDK's own interpreter:

    python signed_urls.py TEMPLATE WORKDIR

A URL made under ``E2B_SANDBOX_URL`` names no sandbox (E2B's own sandbox proxy wants
the ``E2b-Sandbox-Id`` header there too); under ``E2B_DOMAIN`` its host does. So each
request is sent both ways: with the header, and with ``Host: 49983-<id>.<domain>``.
Prints one JSON object of what it saw; the tests assert on it.
"""

import json
import sys
import urllib.error
import urllib.parse
import urllib.request

from e2b import Sandbox


def fetch(url: str, sandbox_id: str, how: str, method: str = "GET",
          body: bytes | None = None, headers: dict | None = None) -> dict:
    parts = urllib.parse.urlsplit(url)
    sent = dict(headers or {})
    if how == "header":
        sent["E2b-Sandbox-Id"] = sandbox_id
    else:
        sent["Host"] = f"49983-{sandbox_id}.sandboxes.example.test"
    request = urllib.request.Request(url, data=body, method=method, headers=sent)
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return {"status": r.status, "body": r.read().decode("utf-8", "replace")}
    except urllib.error.HTTPError as err:
        raw = err.read().decode("utf-8", "replace")
        try:
            message = json.loads(raw).get("message", raw)
        except ValueError:
            message = raw
        return {"status": err.code, "body": message, "path": parts.path}


def with_query(url: str, **changes: str | None) -> str:
    parts = urllib.parse.urlsplit(url)
    query = dict(urllib.parse.parse_qsl(parts.query, keep_blank_values=True))
    for key, value in changes.items():
        if value is None:
            query.pop(key, None)
        else:
            query[key] = value
    return urllib.parse.urlunsplit(parts._replace(
        query=urllib.parse.urlencode(query, quote_via=urllib.parse.quote)))


def multipart(path: str, data: bytes) -> tuple[bytes, str]:
    boundary = "vmfork-signed-url-test"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
            f"filename=\"{path}\"\r\nContent-Type: application/octet-stream\r\n\r\n"
            ).encode() + data + f"\r\n--{boundary}--\r\n".encode()
    return body, f"multipart/form-data; boundary={boundary}"


def main() -> None:
    template, work = sys.argv[1], sys.argv[2]
    seen: dict = {"header": {}, "host": {}}
    sandbox = Sandbox.create(template=template)
    other = Sandbox.create(template=template)
    try:
        path = f"{work}/signed.txt"
        sandbox.files.write(path, "signed content")
        plain = sandbox.download_url(path)
        expiring = sandbox.download_url(path, use_signature_expiration=120)
        expired = sandbox.download_url(path, use_signature_expiration=-30)
        as_root = sandbox.download_url(path, user="root")
        upload = sandbox.upload_url(f"{work}/uploaded.txt", use_signature_expiration=120)
        seen["urls"] = {"plain": plain, "expiring": expiring, "upload": upload}
        signature = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(plain).query))[
            "signature"]
        tampered = signature[:-1] + ("A" if signature[-1] != "A" else "B")
        for how in ("header", "host"):
            out = seen[how]
            out["plain"] = fetch(plain, sandbox.sandbox_id, how)
            out["expiring"] = fetch(expiring, sandbox.sandbox_id, how)
            out["as_root"] = fetch(as_root, sandbox.sandbox_id, how)
            out["expired"] = fetch(expired, sandbox.sandbox_id, how)
            out["tampered"] = fetch(with_query(plain, signature=tampered),
                                    sandbox.sandbox_id, how)
            out["unsigned"] = fetch(with_query(plain, signature=None), sandbox.sandbox_id, how)
            out["other_path"] = fetch(with_query(plain, path=f"{work}/uploaded.txt"),
                                      sandbox.sandbox_id, how)
            out["other_user"] = fetch(with_query(plain, username="root"),
                                      sandbox.sandbox_id, how)
            out["later_expiry"] = fetch(with_query(expiring, signature_expiration=str(
                int(dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(expiring).query))[
                    "signature_expiration"]) + 3600)), sandbox.sandbox_id, how)
            out["bad_expiry"] = fetch(with_query(expiring, signature_expiration="soon"),
                                      sandbox.sandbox_id, how)
            out["other_sandbox"] = fetch(plain, other.sandbox_id, how)
            data = f"uploaded via {how}".encode()
            body, kind = multipart(f"{work}/uploaded.txt", data)
            out["upload"] = fetch(upload, sandbox.sandbox_id, how, "POST", body,
                                  {"Content-Type": kind})
            out["uploaded"] = sandbox.files.read(f"{work}/uploaded.txt")
            # A read URL's signature does not write, nor a write URL's read.
            out["read_url_posted"] = fetch(plain, sandbox.sandbox_id, how, "POST", body,
                                           {"Content-Type": kind})
            out["write_url_read"] = fetch(upload, sandbox.sandbox_id, how)
    finally:
        sandbox.kill()
        other.kill()
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
