"""TLS contexts for the scheduler and its clients, from the settings of reference 001 (tlsconfig.py).

- Mutual: the scheduler asks every client for a certificate, and each side checks the other's
  against `ca_cert_path` (and the CRL, if given). Host names are not checked: the CA is the
  authority on who belongs to the cluster, and the job secret's handshake, which still runs inside
  TLS, says who belongs to this job (docs: README "Security").
- TLS 1.2 or later. `cipher_list` is OpenSSL's list for TLS 1.2; TLS 1.3, which both ends pick
  when they have it, always uses its own AEAD suites (AES-GCM, ChaCha20-Poly1305): Python's ssl
  cannot restrict those.
- PKCS#12 files are opened with `cryptography`; the key reaches OpenSSL through an anonymous
  in-memory file (memfd), encrypted again under a random one-time password: no decrypted key is
  ever written to a disk.
- At start, a certificate that is not yet valid, expired, revoked or not issued by the CA is a
  ConfigError naming the file; one that expires within `cert_expire_warning_time_in_day` is a
  warning naming the file and the days left.

The connection starts in the clear with the scheduler's greeting saying "TLS follows"
(control/auth.py, mode 2), so a process set up without TLS is told at once what to set, instead of
timing out; a client set up with TLS refuses a scheduler that does not offer it.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import logging
import os
import secrets
import ssl
import sys
from typing import TYPE_CHECKING, Mapping

from .. import tlsconfig
from ..errors import (
    AuthenticationFailed,
    ConfigError,
    SchedulerUnavailable,
    TrainguardError,
)
from ..files import read_small_file
from ..tlsconfig import TLSConfig

if TYPE_CHECKING:
    from cryptography import x509

log = logging.getLogger("trainguard.tls")

MAX_FILE_BYTES = 1024 * 1024  # a certificate bundle, a PKCS#12 file or a CRL
HANDSHAKE_TIMEOUT_S = 5.0
HINT = "the TLS files are set in TG_SSL_CONFIG (`trainguard certs DIR` makes a CA and certificates to try)"

# a TLS alert from the peer (OpenSSL's reason code) -> what it means here
ALERTS = {
    "SSLV3_ALERT_CERTIFICATE_EXPIRED": "it refused this process's certificate: expired",
    "SSLV3_ALERT_CERTIFICATE_REVOKED": "it refused this process's certificate: revoked by the CA's CRL",
    "TLSV1_ALERT_UNKNOWN_CA": "it refused this process's certificate: not issued by its CA",
    "SSLV3_ALERT_BAD_CERTIFICATE": "it refused this process's certificate (not yet valid, or not usable)",
    "SSLV3_ALERT_UNSUPPORTED_CERTIFICATE": "it refused this process's certificate: unsupported",
    "TLSV13_ALERT_CERTIFICATE_REQUIRED": "it requires a client certificate and got none",
    "PEER_DID_NOT_RETURN_A_CERTIFICATE": "the peer sent no certificate",
    "NO_SHARED_CIPHER": "no cipher in common (compare the cipher_list of both sides)",
    "SSLV3_ALERT_HANDSHAKE_FAILURE": "no cipher or TLS version in common (compare the cipher_list of both sides)",
    "UNSUPPORTED_PROTOCOL": "the peer offers only TLS versions below 1.2",
    "TLSV1_ALERT_PROTOCOL_VERSION": "no TLS version in common (1.2 or later is required)",
    "WRONG_VERSION_NUMBER": "the peer does not speak TLS",
    "HTTP_REQUEST": "the peer does not speak TLS",
}


def now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def validity(cert: x509.Certificate, at: dt.datetime) -> tuple[str | None, int]:
    """(what is wrong with the certificate at `at`, or None; whole days it has left). Pure."""
    if at < cert.not_valid_before_utc:
        return f"not valid before {cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC", 0
    if at > cert.not_valid_after_utc:
        return f"expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC", 0
    return None, (cert.not_valid_after_utc - at).days


def check_certificate(cert: x509.Certificate, where: str, warn_days: int, at: dt.datetime) -> None:
    problem, days = validity(cert, at)
    if problem is not None:
        raise ConfigError(f"{where}: the certificate ({cert.subject.rfc4514_string()}) is {problem}; issue a new one "
                          "(or check this host's clock)")
    if days < warn_days:
        log.warning("TLS certificate %s (%s) expires in %d days, on %s UTC: renew it", where,
                    cert.subject.rfc4514_string(), days, f"{cert.not_valid_after_utc:%Y-%m-%d}")


def load_p12(path, password: bytes | None, password_env: str):
    """(key, certificate, extra certificates) of a PKCS#12 file, or ConfigError naming it and the fix."""
    # lazily, as every cryptography import here: ~70 ms, for TLS jobs only
    from cryptography.hazmat.primitives.serialization import pkcs12

    data = _read(path)
    try:
        key, cert, extra = pkcs12.load_key_and_certificates(data, password)
    except (ValueError, TypeError):
        why = "no password was given" if password is None else "the password is wrong"
        raise ConfigError(f"{path}: cannot open this PKCS#12 file: {why}, or it is not PKCS#12 (set {password_env} "
                          f"or {password_env}_FILE to its password); {HINT}") from None
    if key is None or cert is None:
        raise ConfigError(f"{path}: this PKCS#12 file must hold a certificate and its private key; {HINT}")
    return key, cert, list(extra)


@functools.lru_cache(maxsize=8)
def server_context(cfg: TLSConfig) -> ssl.SSLContext:
    return _context(cfg, server=True)


@functools.lru_cache(maxsize=8)
def client_context(cfg: TLSConfig) -> ssl.SSLContext:
    return _context(cfg, server=False)


def scheduler_context(cfg: TLSConfig | None) -> ssl.SSLContext | None:
    """The scheduler's context, built (and so checked) before it listens; None without TLS."""
    if cfg is None:
        return None
    if not hasattr(asyncio, "timeout"):
        raise ConfigError("TLS needs Python 3.11 or later on the scheduler's host (asyncio.timeout); "
                          f"this is {sys.version.split()[0]}. Unset TG_ENABLE_SSL or use a newer Python")
    ctx = server_context(cfg)
    log.info("TLS on (%s): TLS 1.2 or later, every client must show a certificate from %s", cfg.source, cfg.ca_cert)
    return ctx


def client_context_from(env: Mapping[str, str] | None = None) -> ssl.SSLContext | None:
    """This process's client context (TG_ENABLE_SSL, TG_SSL_CONFIG), or None without TLS."""
    cfg = tlsconfig.read(os.environ if env is None else env)
    return None if cfg is None else client_context(cfg)


def _context(cfg: TLSConfig, *, server: bool) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False  # the CA vouches for cluster members; see the module's docstring
    ctx.verify_mode = ssl.CERT_REQUIRED
    if cfg.cipher_list:
        try:
            ctx.set_ciphers(cfg.cipher_list)
        except ssl.SSLError:
            raise ConfigError(f"{cfg.source}: cipher_list names no cipher this OpenSSL ({ssl.OPENSSL_VERSION}) "
                              "knows; use OpenSSL names, e.g. ECDHE-RSA-AES128-GCM-SHA256") from None
    at = now()
    cas = _load_cas(ctx, cfg, at)
    path, password, env_name = ((cfg.server_cert, cfg.server_password, tlsconfig.SERVER_PASSWORD_ENV) if server else
                                (cfg.client_cert, cfg.client_password, tlsconfig.CLIENT_PASSWORD_ENV))
    key, cert, extra = load_p12(path, password, env_name)
    check_certificate(cert, str(path), cfg.warn_days, at)
    if not any(_issued_by(cert, ca) for ca in cas):
        raise ConfigError(f"{path}: its certificate ({cert.subject.rfc4514_string()}) was not issued by a CA in "
                          f"{cfg.ca_cert}, so no peer would accept it; {HINT}")
    if cfg.crl is not None:
        revoked = _load_crl(ctx, cfg, cas, at)
        if cert.serial_number in revoked:
            raise ConfigError(f"{path}: its certificate (serial {cert.serial_number}) is revoked by {cfg.crl}; "
                              "issue a new one")
    _load_chain(ctx, key, cert, extra, path)
    return ctx


def _load_cas(ctx: ssl.SSLContext, cfg: TLSConfig, at: dt.datetime) -> list[x509.Certificate]:
    from cryptography import x509

    try:
        cas = x509.load_pem_x509_certificates(_read(cfg.ca_cert))
        ctx.load_verify_locations(cafile=str(cfg.ca_cert))
    except (ValueError, ssl.SSLError) as exc:
        raise ConfigError(f"{cfg.ca_cert}: not a PEM file of CA certificates ({exc}); {HINT}") from None
    for ca in cas:
        check_certificate(ca, str(cfg.ca_cert), cfg.warn_days, at)
    return cas


def _load_crl(ctx: ssl.SSLContext, cfg: TLSConfig, cas: list[x509.Certificate], at: dt.datetime) -> set[int]:
    """Load the CRL into the context (leaf certificates are checked against it); the revoked serials."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    data = _read(cfg.crl)
    try:
        crl = x509.load_pem_x509_crl(data) if b"-----BEGIN" in data else x509.load_der_x509_crl(data)
    except ValueError:
        raise ConfigError(f"{cfg.crl}: not a certificate revocation list (PEM or DER); {HINT}") from None
    issuer = next((ca for ca in cas if ca.subject == crl.issuer), None)
    if issuer is None or not crl.is_signature_valid(issuer.public_key()):
        raise ConfigError(f"{cfg.crl}: this CRL is not signed by a CA in {cfg.ca_cert}; use the CA's own CRL")
    if crl.next_update_utc is not None and at > crl.next_update_utc:
        raise ConfigError(f"{cfg.crl}: this CRL is out of date since {crl.next_update_utc:%Y-%m-%d %H:%M} UTC and "
                          "every peer would be refused; publish a fresh one from the CA")
    _from_memory(crl.public_bytes(serialization.Encoding.PEM), lambda p: ctx.load_verify_locations(cafile=p))
    ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
    return {entry.serial_number for entry in crl}


def _load_chain(ctx: ssl.SSLContext, key, cert: x509.Certificate, extra: list, path) -> None:
    from cryptography.hazmat.primitives import serialization

    once = secrets.token_hex(32).encode()  # the key crosses to OpenSSL encrypted under this, in memory only
    pem = b"".join(c.public_bytes(serialization.Encoding.PEM) for c in [cert, *extra])
    pem += key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.BestAvailableEncryption(once))
    try:
        _from_memory(pem, lambda p: ctx.load_cert_chain(p, password=once))
    except ssl.SSLError as exc:
        raise ConfigError(f"{path}: OpenSSL refused this certificate or key ({exc.reason or exc}); {HINT}") from None


def _from_memory(data: bytes, use) -> None:
    """Hand `data` to an OpenSSL call that wants a file name, through a memfd (never on a disk)."""
    fd = os.memfd_create("trainguard-tls", os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        use(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)


def _issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    from cryptography.exceptions import InvalidSignature

    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):  # another issuer's name, key type, or signature
        return False
    return True


def _read(path) -> bytes:
    return read_small_file(path, MAX_FILE_BYTES, str(path))


# --- what a failed handshake means ------------------------------------------------------------


FOREIGN = {18, 19, 20, 21}  # X509_V_ERR_*: self-signed, self-signed in chain, issuer unknown, leaf unverifiable


def refusal(exc: BaseException) -> str:
    """Why a TLS handshake failed, in words (from the exception's type and OpenSSL's reason and verify codes)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"its certificate was refused: {verify_words(exc)}"
    reason = getattr(exc, "reason", None)
    if reason in ALERTS:
        return ALERTS[reason]
    if isinstance(exc, (TimeoutError, ssl.SSLEOFError, ssl.SSLZeroReturnError, ConnectionError)):
        return f"the TLS handshake did not finish ({type(exc).__name__})"
    return f"TLS failed: {reason or exc}"


def verify_words(exc: ssl.SSLCertVerificationError) -> str:
    if exc.verify_code in FOREIGN:
        return f"{exc.verify_message} (it is not from this CA: another cluster's?)"
    return str(exc.verify_message)


def client_failure(exc: ssl.SSLError, where: str) -> TrainguardError:
    """A client's handshake or first read failed: a refusal (deterministic) or a lost connection (a fault)."""
    if isinstance(exc, (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError)):
        return SchedulerUnavailable(f"{where}: the TLS connection was cut: {exc}")
    why = refusal(exc)
    if isinstance(exc, ssl.SSLCertVerificationError):
        why = f"the scheduler's certificate was refused: {verify_words(exc)}"
    return AuthenticationFailed(f"{where}: TLS: {why}; {HINT}")
