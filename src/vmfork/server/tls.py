"""TLS for the daemon's TCP listener: ``vmfork serve --bind … --tls-cert C --tls-key K``.

The Unix socket stays plain (the kernel already says who may connect: its mode is
0600). A TCP listener reachable from another host carries the bearer token, so it
should be TLS; forkd has the same two flags.

The context is the standard library's, which is OpenSSL underneath: TLS 1.2 at least
(``minimum_version``), OpenSSL's default cipher list for the server side, no
compression, no renegotiation. The certificate and key are read once at start-up;
a key that does not match the certificate, a file that is not PEM, or an expired
certificate stops the daemon with the file's name rather than failing every
handshake later.
"""

from __future__ import annotations

import datetime
import ssl
from dataclasses import dataclass
from pathlib import Path

# Below this many days of validity left, doctor warns (a daemon still starts).
EXPIRY_WARNING_DAYS = 14


class TlsConfigError(ValueError):
    """``--tls-cert``/``--tls-key`` cannot be used; the message names the file and why."""


@dataclass(frozen=True)
class CertificateInfo:
    """What doctor and the start-up check read off a PEM certificate."""

    subject: str
    names: tuple[str, ...]             # DNS names and IP addresses it is valid for
    not_before: datetime.datetime
    not_after: datetime.datetime

    def days_left(self, now: datetime.datetime | None = None) -> float:
        now = now or datetime.datetime.now(datetime.UTC)
        return (self.not_after - now).total_seconds() / 86400


def read_certificate(path: Path) -> CertificateInfo:
    """The first certificate of a PEM file (the server's own; a chain may follow)."""
    from cryptography import x509

    try:
        data = path.read_bytes()
    except OSError as err:
        raise TlsConfigError(f"--tls-cert {path}: cannot read it: {err.strerror}") from err
    try:
        cert = x509.load_pem_x509_certificate(data)
    except ValueError as err:
        raise TlsConfigError(f"--tls-cert {path}: not a PEM certificate ({err})") from err
    names: list[str] = []
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        pass
    else:
        names += san.get_values_for_type(x509.DNSName)
        names += [str(ip) for ip in san.get_values_for_type(x509.IPAddress)]
    return CertificateInfo(cert.subject.rfc4514_string(), tuple(names),
                           cert.not_valid_before_utc, cert.not_valid_after_utc)


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    """The listener's context, or ``TlsConfigError`` saying which file is wrong."""
    info = read_certificate(cert)
    now = datetime.datetime.now(datetime.UTC)
    if info.not_after <= now:
        raise TlsConfigError(f"--tls-cert {cert}: expired on {info.not_after:%Y-%m-%d}")
    if info.not_before > now:
        raise TlsConfigError(f"--tls-cert {cert}: not valid before {info.not_before:%Y-%m-%d}")
    try:
        key.read_bytes()
    except OSError as err:
        raise TlsConfigError(f"--tls-key {key}: cannot read it: {err.strerror}") from err
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.options |= ssl.OP_NO_COMPRESSION | ssl.OP_NO_RENEGOTIATION
    try:
        context.load_cert_chain(str(cert), str(key))
    except ssl.SSLError as err:
        reason = err.reason or str(err)
        if "KEY_VALUES_MISMATCH" in reason.upper():
            raise TlsConfigError(f"--tls-key {key} is not the key of --tls-cert {cert}") from err
        raise TlsConfigError(f"--tls-key {key}: not a usable PEM private key ({reason})") from err
    return context

