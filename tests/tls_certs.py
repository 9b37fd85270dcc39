"""Certificates made at test time: a CA and server certificates it signs (or not).

Used by the TLS tests in Python (tests/unit/test_tls.py) and TypeScript
(sdk/typescript/test/tls.test.ts, through ``python -m tests.tls_certs DIR``). Keys are
P-256: quick to make, and what a real deployment would likely use.
"""

from __future__ import annotations

import datetime
import ipaddress
import sys
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write(directory: Path, name: str, cert: x509.Certificate,
           key: ec.EllipticCurvePrivateKey) -> Pair:
    pair = Pair(directory / f"{name}.pem", directory / f"{name}.key")
    pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pair.key.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    pair.key.chmod(0o600)
    return pair


def make_ca(directory: Path, name: str = "ca") -> tuple[Pair, x509.Certificate,
                                                        ec.EllipticCurvePrivateKey]:
    key = _key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"vmfork test {name}")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return _write(directory, name, cert, key), cert, key


def make_server(directory: Path, ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey,
                name: str = "server", *, hosts: tuple[str, ...] = ("localhost", "127.0.0.1"),
                days: float = 30, start_days_ago: float = 0) -> Pair:
    key = _key()
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    start = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=start_days_ago,
                                                                     minutes=5)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                                           f"vmfork test {name}")]))
               .issuer_name(ca.subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(start + datetime.timedelta(days=days))
               .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]),
                              critical=False))
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return _write(directory, name, builder.sign(ca_key, hashes.SHA256()), key)


def main(argv: list[str]) -> int:
    """``python -m tests.tls_certs DIR``: DIR/ca.pem, DIR/server.{pem,key}."""
    directory = Path(argv[0])
    directory.mkdir(parents=True, exist_ok=True)
    _, ca, ca_key = make_ca(directory)
    make_server(directory, ca, ca_key)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
