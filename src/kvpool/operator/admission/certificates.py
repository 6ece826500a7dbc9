"""The webhook's TLS: a CA and a serving certificate made at start (``cryptography``), or
the files of a directory that cert-manager fills (``tls.crt``, ``tls.key``, ``ca.crt``).

A made CA lives as long as the process: its certificate is published as the webhook's
``caBundle`` (kopf patches the MutatingWebhookConfiguration), and its key is dropped once
the serving certificate is signed. The serving certificate names every host the API
server may dial (a Service's DNS names, or the ``--webhook-url-host``), IP addresses as
IP SANs.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CERT_FILE = "tls.crt"
KEY_FILE = "tls.key"
CA_FILE = "ca.crt"
"""The names cert-manager gives a certificate's Secret keys (and so the mounted files)."""
VALIDITY = datetime.timedelta(days=3650)


@dataclass(frozen=True)
class Made:
    """PEM: the CA's certificate (the caBundle), the serving certificate and its key."""

    ca: bytes
    cert: bytes
    key: bytes


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64])])


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def make(hosts: Sequence[str], now: datetime.datetime | None = None) -> Made:
    """A new CA and a serving certificate for ``hosts`` (DNS names or IP addresses)."""
    if not hosts:
        raise ValueError("a serving certificate needs at least one host")
    start = (now or datetime.datetime.now(datetime.UTC)) - datetime.timedelta(minutes=5)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("kvpool-operator webhook CA")
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(hosts[0]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.SubjectAlternativeName([_san(host) for host in dict.fromkeys(hosts)]),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
            critical=False,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return Made(
        ca=ca.public_bytes(serialization.Encoding.PEM),
        cert=cert.public_bytes(serialization.Encoding.PEM),
        key=key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )


def write(made: Made, directory: Path) -> None:
    """``made`` as cert-manager's three files in ``directory`` (the key 0600)."""
    (directory / CA_FILE).write_bytes(made.ca)
    (directory / CERT_FILE).write_bytes(made.cert)
    key = directory / KEY_FILE
    key.touch(mode=0o600)
    key.write_bytes(made.key)


def problem(directory: Path) -> str | None:
    """What a certificate directory lacks, in one line (``ca.crt`` is optional: without it
    the serving certificate is published as the caBundle)."""
    if not directory.is_dir():
        return f"{directory}: not a directory"
    missing = [name for name in (CERT_FILE, KEY_FILE) if not (directory / name).is_file()]
    return f"{directory}: no {' or '.join(missing)} in it" if missing else None
