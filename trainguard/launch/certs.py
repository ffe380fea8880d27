"""`trainguard certs DIR`: a test CA and certificates, to try TLS in a minute (reference 001's layout).

    trainguard certs ./tls --hosts node1,node2
    export TG_ENABLE_SSL=1 TG_SSL_CONFIG=./tls/ssl.json \\
           TG_SERVER_PASSWORD_FILE=./tls/server.password TG_CLIENT_PASSWORD_FILE=./tls/client.password
    trainguard run --workers 2 train.py

DIR gets ca.crt, ca.key (the CA's key, mode 0600: whoever holds it can mint members), server.p12
and client.p12 (each a certificate and its key, encrypted with a random password kept in
server.password / client.password, mode 0600), crl.pem (the CA's revocation list, empty) and
ssl.json. Keys are ECDSA P-256. For production, use your own CA; the functions here also serve
the tests, which make expired, not-yet-valid, revoked and foreign certificates with them.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import secrets
from pathlib import Path
from typing import Sequence

from ..errors import ConfigError

DEFAULT_DAYS = 365
CIPHERS = ("ECDHE-ECDSA-AES128-GCM-SHA256:ECDHE-ECDSA-AES256-GCM-SHA384:ECDHE-ECDSA-CHACHA20-POLY1305:"
           "ECDHE-RSA-AES128-GCM-SHA256:ECDHE-RSA-AES256-GCM-SHA384")
FILES = ("ca.crt", "ca.key", "server.p12", "client.p12", "server.password", "client.password", "crl.pem", "ssl.json")


def add_parser(sub) -> None:
    certs = sub.add_parser("certs", help="make a test CA, server and client certificates and ssl.json (TLS)")
    certs.add_argument("dir", type=Path, metavar="DIR", help="an empty or new folder")
    certs.add_argument("--hosts", default="", help="comma-separated names and addresses for the server certificate")
    certs.add_argument("--days", type=int, default=DEFAULT_DAYS, help=f"validity (default {DEFAULT_DAYS})")
    certs.set_defaults(handler=run)


def run(args) -> int:
    if not 1 <= args.days <= 36500:
        raise ConfigError(f"--days {args.days}: expected 1..36500")
    config = make_test_pki(args.dir, hosts=[h for h in args.hosts.split(",") if h.strip()], days=args.days)
    d = config.parent
    print(f"wrote {', '.join(FILES)} to {d}\nto use them:\n"
          f"  export TG_ENABLE_SSL=1 TG_SSL_CONFIG={config} TG_SERVER_PASSWORD_FILE={d / 'server.password'} "
          f"TG_CLIENT_PASSWORD_FILE={d / 'client.password'}\n  (or: trainguard run --ssl-config {config} ...)")
    return 0


def make_test_pki(folder: Path, *, hosts: Sequence[str] = (), days: int = DEFAULT_DAYS) -> Path:
    """Write a CA, a server and a client certificate, an empty CRL and ssl.json to `folder`; ssl.json's path.
    Refuses a folder that already holds any of these files (nothing is overwritten)."""
    folder = Path(folder).expanduser().resolve()
    taken = [n for n in FILES if (folder / n).exists()]
    if taken:
        raise ConfigError(f"{folder} already holds {taken[0]}: choose a new or empty folder (nothing was changed)")
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, ca = make_ca(days=days)
    write(folder / "ca.crt", pem(ca))
    write(folder / "ca.key", key_pem(ca_key), private=True)
    for role in ("server", "client"):
        key, cert = issue(ca_key, ca, f"trainguard {role}", server=role == "server", hosts=hosts, days=days)
        password = secrets.token_hex(16).encode()
        write(folder / f"{role}.password", password + b"\n", private=True)
        write(folder / f"{role}.p12", p12(key, cert, password), private=True)
    write(folder / "crl.pem", crl(ca_key, ca))
    config = {"server_cert_path": "server.p12", "client_cert_path": "client.p12", "ca_cert_path": "ca.crt",
              "crl_path": "crl.pem", "cipher_list": CIPHERS, "cert_expire_warning_time_in_day": 90}
    write(folder / "ssl.json", (json.dumps(config, indent=2) + "\n").encode())
    return folder / "ssl.json"


# --- the pieces (the tests use them too) -----------------------------------------------------------


def _window(days: int, not_before: dt.datetime | None) -> tuple[dt.datetime, dt.datetime]:
    start = not_before or dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=5)
    return start, start + dt.timedelta(days=days)


def make_ca(name: str = "trainguard test CA", *, days: int = DEFAULT_DAYS, not_before: dt.datetime | None = None):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    start, end = _window(days, not_before)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return key, cert


def issue(ca_key, ca, name: str, *, server: bool, hosts: Sequence[str] = (), days: int = DEFAULT_DAYS,
          not_before: dt.datetime | None = None):
    """(key, certificate) for a server (serverAuth) or a client (clientAuth), signed by the CA."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    start, end = _window(days, not_before)
    names: list[x509.GeneralName] = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host.strip())))
        except ValueError:
            names.append(x509.DNSName(host.strip()))
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return key, cert


def crl(ca_key, ca, revoked: Sequence[int] = (), *, days: int = 30) -> bytes:
    """The CA's revocation list (PEM) naming the revoked serial numbers."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization

    now = dt.datetime.now(dt.timezone.utc)
    builder = (x509.CertificateRevocationListBuilder().issuer_name(ca.subject)
               .last_update(now - dt.timedelta(minutes=5)).next_update(now + dt.timedelta(days=days)))
    for serial in revoked:
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(now - dt.timedelta(minutes=1))
            .build())
    return builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def p12(key, cert, password: bytes) -> bytes:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.serialization import pkcs12

    return pkcs12.serialize_key_and_certificates(b"trainguard", key, cert, None,
                                                 serialization.BestAvailableEncryption(password))


def pem(cert) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def key_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def load_key(path: Path):
    from cryptography.hazmat.primitives import serialization

    return serialization.load_pem_private_key(Path(path).read_bytes(), password=None)


def write(path: Path, data: bytes, *, private: bool = False) -> None:
    """Create `path` (never overwrite), mode 0600 if private."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
