"""TLS between every process and the scheduler: the settings, as reference 001 (MindSpore) gives them.

    TG_ENABLE_SSL=1  TG_SSL_CONFIG=/path/ssl.json      (`trainguard run --ssl-config ssl.json` sets both)

    {
      "server_cert_path": "server.p12",     PKCS#12: the scheduler's certificate and its encrypted key
      "client_cert_path": "client.p12",     PKCS#12: every other process's certificate and key
      "ca_cert_path": "ca.crt",             PEM: the CA both sides check the other's certificate against
      "crl_path": "crl.pem",                PEM or DER, may be "": certificates the CA revoked
      "cipher_list": "ECDHE-RSA-AES128-GCM-SHA256:...",   OpenSSL names; TLS 1.2's suites (see control/tls.py)
      "cert_expire_warning_time_in_day": 90
    }

Relative paths are taken from the file's own folder. The keys' passwords come from TG_SERVER_PASSWORD
and TG_CLIENT_PASSWORD, or from the files TG_SERVER_PASSWORD_FILE and TG_CLIENT_PASSWORD_FILE name,
never from a command line. This module only reads and checks the settings (no ssl, no cryptography):
control/tls.py builds the contexts from them.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from .errors import ConfigError
from .files import read_small_file

ENABLE_SSL_ENV = "TG_ENABLE_SSL"
SSL_CONFIG_ENV = "TG_SSL_CONFIG"
SERVER_PASSWORD_ENV, SERVER_PASSWORD_FILE_ENV = "TG_SERVER_PASSWORD", "TG_SERVER_PASSWORD_FILE"
CLIENT_PASSWORD_ENV, CLIENT_PASSWORD_FILE_ENV = "TG_CLIENT_PASSWORD", "TG_CLIENT_PASSWORD_FILE"
MAX_CONFIG_BYTES = 64 * 1024
MAX_PASSWORD_BYTES = 1024
DEFAULT_WARN_DAYS = 90
KEYS = ("server_cert_path", "client_cert_path", "ca_cert_path", "crl_path", "cipher_list",
        "cert_expire_warning_time_in_day")
REQUIRED = ("server_cert_path", "client_cert_path", "ca_cert_path")


@dataclass(frozen=True, slots=True)
class TLSConfig:
    source: Path  # the JSON file, named in every error
    server_cert: Path
    client_cert: Path
    ca_cert: Path
    crl: Path | None = None
    cipher_list: str | None = None  # None: OpenSSL's defaults for TLS 1.2
    warn_days: int = DEFAULT_WARN_DAYS
    server_password: bytes | None = field(default=None, repr=False)
    client_password: bytes | None = field(default=None, repr=False)


def enabled(env: Mapping[str, str]) -> bool:
    raw = env.get(ENABLE_SSL_ENV, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ConfigError(f"{ENABLE_SSL_ENV}={raw!r} is invalid: expected 1/0 (or true/false)")


def read(env: Mapping[str, str]) -> TLSConfig | None:
    """The TLS settings, or None when TLS is off; ConfigError names the variable, file or key at fault."""
    path = env.get(SSL_CONFIG_ENV, "").strip()
    if not enabled(env):
        if path:
            raise ConfigError(f"{SSL_CONFIG_ENV} is set but {ENABLE_SSL_ENV} is not: set {ENABLE_SSL_ENV}=1 to use "
                              f"TLS, or unset {SSL_CONFIG_ENV}")
        return None
    if not path:
        raise ConfigError(f"{ENABLE_SSL_ENV}=1 needs {SSL_CONFIG_ENV}: the path of a JSON file with server_cert_path, "
                          "client_cert_path, ca_cert_path (`trainguard certs DIR` makes one to try)")
    source = Path(path).expanduser().resolve()
    data = _json(source)
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise ConfigError(f"{SSL_CONFIG_ENV}={source}: unknown key {unknown[0]!r}; the keys are {', '.join(KEYS)}")
    missing = [k for k in REQUIRED if not data.get(k)]
    if missing:
        raise ConfigError(f"{SSL_CONFIG_ENV}={source}: {missing[0]} is missing or empty")
    for key in KEYS[:5]:
        if data.get(key) is not None and not isinstance(data[key], str):
            raise ConfigError(f"{SSL_CONFIG_ENV}={source}: {key} must be a string (\"\" or null for none)")
    days = data.get("cert_expire_warning_time_in_day", DEFAULT_WARN_DAYS)
    if isinstance(days, bool) or not isinstance(days, int) or not 0 <= days <= 36500:
        raise ConfigError(f"{SSL_CONFIG_ENV}={source}: cert_expire_warning_time_in_day must be a whole number of "
                          f"days in 0..36500, got {days!r}")
    files = {key: _file(source, key, data[key]) for key in REQUIRED}
    crl = _file(source, "crl_path", data["crl_path"]) if data.get("crl_path") else None
    ciphers = (data.get("cipher_list") or "").strip() or None
    return TLSConfig(source=source, server_cert=files["server_cert_path"], client_cert=files["client_cert_path"],
                     ca_cert=files["ca_cert_path"], crl=crl, cipher_list=ciphers, warn_days=days,
                     server_password=password(env, SERVER_PASSWORD_ENV, SERVER_PASSWORD_FILE_ENV),
                     client_password=password(env, CLIENT_PASSWORD_ENV, CLIENT_PASSWORD_FILE_ENV))


def password(env: Mapping[str, str], name: str, file_name: str) -> bytes | None:
    raw, path = env.get(name, ""), env.get(file_name, "").strip()
    if raw and path:
        raise ConfigError(f"both {name} and {file_name} are set; set only one of them")
    if not path:
        return raw.encode() if raw else None
    text = read_small_file(Path(path), MAX_PASSWORD_BYTES, f"{file_name}={path}").rstrip(b"\r\n")
    if not text:
        raise ConfigError(f"{file_name}={path}: the file is empty")
    return text


def _json(source: Path) -> dict:
    text = read_small_file(source, MAX_CONFIG_BYTES, f"{SSL_CONFIG_ENV}={source}")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"{SSL_CONFIG_ENV}={source}: not valid JSON ({str(exc).splitlines()[0][:200]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{SSL_CONFIG_ENV}={source}: expected a JSON object with the keys {', '.join(KEYS)}")
    return data


def _file(source: Path, key: str, value: str) -> Path:
    path = Path(value).expanduser()
    path = path if path.is_absolute() else source.parent / path
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ConfigError(f"{SSL_CONFIG_ENV}={source}: {key} {str(path)!r}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{SSL_CONFIG_ENV}={source}: {key} {str(path)!r} is not a regular file")
    return path
