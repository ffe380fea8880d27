"""Who may talk to the scheduler: a challenge-response handshake on the job's shared secret.

Every connection starts with it, before any frame. The scheduler speaks first:

    scheduler -> client   b"TGA" | version | mode (0 open, 1 secret) | nonce_s (32 random bytes)
    client -> scheduler   nonce_c (32 random bytes) | HMAC-SHA256(secret, b"TG-client" nonce_s nonce_c)
    scheduler -> client   ok (1 byte: 1 or 0) | HMAC-SHA256(secret, b"TG-server" nonce_s nonce_c)

With TLS (control/tls.py) the scheduler first sends the same header with mode 2 ("TLS follows") and
32 zero bytes; both sides then run the TLS handshake and the exchange above runs inside it.

Both sides prove they know the secret without sending it, and fresh nonces on both sides make a
recorded handshake worthless. The client checks the scheduler's proof too, so an agent obeys
placement orders, and a worker its rank, only from the real scheduler. A client that holds a
secret refuses a scheduler that does not ask for one (a stranger posing as it). Why a handshake
and not an HMAC on every frame or TLS-PSK: the frames then cost nothing more (a heartbeat is one
round trip, bench/control_plane.py), and Python's ssl has PSK only from 3.13. Alone, it does not
hide or protect the frames of an established connection from someone on the network path: turn
TLS on for that (TG_ENABLE_SSL); neither touches gloo's traffic between workers (README, "Security").

The scheduler's side runs in its connections (conn.py), with `hello` and `judge`; the client's is
`client_handshake`.

`trainguard run` gives its workers `worker_secret(job secret)` instead: the scheduler tells the two
apart by which one the answer proves, and serves the agents' requests (AGENT_ONLY) only to a holder
of the job secret itself.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import socket
import ssl

from ..errors import (
    AuthenticationFailed,
    ConfigError,
    SchedulerUnavailable,
    TrainguardError,
)
from .tls import client_failure

MAGIC = b"TGA"
VERSION = 1
NONCE = 32
OPEN, SECRET, TLS_FOLLOWS = 0, 1, 2  # the greeting's mode
HELLO_SIZE = len(MAGIC) + 2 + NONCE
TLS_GREETING = MAGIC + bytes([VERSION, TLS_FOLLOWS]) + bytes(NONCE)
ANSWER_SIZE = NONCE + 32
VERDICT_SIZE = 1 + 32
AGENT_ONLY = frozenset({"agent_sync", "agent_place", "host_beat", "process_exited"})  # requests a worker may not send
TIMEOUT_S = 5.0  # a client that has not finished its TLS handshake, or answered the challenge, by then is dropped
HINT = ("give every process of the job the same secret: TG_JOB_SECRET_FILE=path (or TG_JOB_SECRET); "
        "`trainguard run` writes its own to <recovery path>/job.secret")


def proof(secret: bytes, side: bytes, nonce_s: bytes, nonce_c: bytes) -> bytes:
    return hmac.digest(secret, b"TG-" + side + nonce_s + nonce_c, "sha256")


def hello(secret: bytes | None) -> tuple[bytes, bytes]:
    """(the scheduler's first bytes, its nonce)."""
    nonce = os.urandom(NONCE)
    return MAGIC + bytes([VERSION, 1 if secret is not None else 0]) + nonce, nonce


def check_answer(secret: bytes, nonce_s: bytes, answer: bytes) -> bytes:
    """The scheduler's verdict on a client's answer (pure but for the comparison's constant time)."""
    nonce_c, mac = answer[:NONCE], answer[NONCE:]
    if hmac.compare_digest(mac, proof(secret, b"client", nonce_s, nonce_c)):
        return b"\x01" + proof(secret, b"server", nonce_s, nonce_c)
    return b"\x00" + bytes(32)


def worker_secret(secret: bytes) -> bytes:
    """The secret `trainguard run` gives its workers instead of the job secret: derived from it (so the scheduler
    knows it) by a one-way function (so a worker, which runs the user's script, cannot learn the job secret).
    It admits a worker's requests but not an agent's (AGENT_ONLY): no worker can speak as an agent."""
    return hmac.new(secret, b"TG-worker-secret", hashlib.sha256).hexdigest().encode()


def judge(secret: bytes, nonce_s: bytes, answer: bytes) -> tuple[bytes, bool]:
    """The scheduler's verdict on a client's answer, to send back, and whether the client is an agent (it
    proved the job secret itself, not a worker's derived secret). The verdict's first byte is 1 if admitted."""
    verdict = check_answer(secret, nonce_s, answer)
    if verdict[0] == 1:
        return verdict, True
    return check_answer(worker_secret(secret), nonce_s, answer), False


def client_handshake(sock: socket.socket, secret: bytes | None, where: str,
                     tls_context: ssl.SSLContext | None = None) -> socket.socket:
    """Run the client's side on a fresh connection; the socket to use from now on (TLS-wrapped if the job
    uses TLS). AuthenticationFailed says what is wrong and how to fix it."""
    mode, nonce_s = _greeting(sock, where)
    if mode == TLS_FOLLOWS:
        if tls_context is None:
            raise AuthenticationFailed(f"{where} requires TLS and this process has no TLS settings: set "
                                       "TG_ENABLE_SSL=1 and TG_SSL_CONFIG as for the scheduler")
        plain, sock = sock, None
        try:
            sock = tls_context.wrap_socket(plain)
            mode, nonce_s = _greeting(sock, where)  # the first read shows a refusal of our certificate (TLS 1.3)
            if mode == TLS_FOLLOWS:
                raise AuthenticationFailed(f"{where} asked for TLS twice: not a trainguard scheduler")
            _prove(sock, secret, mode, nonce_s, where)
            return sock
        except (ssl.SSLError, OSError, TrainguardError) as exc:
            if sock is not None:
                sock.close()
            if isinstance(exc, TrainguardError):
                raise
            if isinstance(exc, ssl.SSLError):
                raise client_failure(exc, where) from None
            raise SchedulerUnavailable(f"{where}: the TLS handshake failed: {exc}") from None
    elif tls_context is not None:
        raise AuthenticationFailed(f"{where} does not offer TLS but this process is set up for it (TG_ENABLE_SSL): "
                                   "refusing to talk in the clear; set TLS up the same on every process")
    _prove(sock, secret, mode, nonce_s, where)
    return sock


def _greeting(sock: socket.socket, where: str) -> tuple[int, bytes]:
    head = _recv(sock, HELLO_SIZE, where)
    if head[:len(MAGIC)] != MAGIC or head[len(MAGIC)] != VERSION:
        raise AuthenticationFailed(f"{where} did not greet as a trainguard scheduler of this version")
    return head[len(MAGIC) + 1], head[len(MAGIC) + 2:]


def _prove(sock: socket.socket, secret: bytes | None, mode: int, nonce_s: bytes, where: str) -> None:
    if mode == OPEN:
        if secret is not None:
            raise AuthenticationFailed(f"{where} asks for no job secret but this process has one: refusing it "
                                       f"(a stranger posing as the scheduler?); {HINT}")
        return
    if secret is None:
        raise AuthenticationFailed(f"{where} requires the job secret and this process has none; {HINT}")
    nonce_c = os.urandom(NONCE)
    sock.sendall(nonce_c + proof(secret, b"client", nonce_s, nonce_c))
    verdict = _recv(sock, VERDICT_SIZE, where)
    if verdict[0] != 1:
        raise AuthenticationFailed(f"{where} refused this process's job secret (it differs from the scheduler's); "
                                   f"{HINT}")
    if not hmac.compare_digest(verdict[1:], proof(secret, b"server", nonce_s, nonce_c)):
        raise AuthenticationFailed(f"{where} did not prove it knows the job secret: not our scheduler")


def _recv(sock: socket.socket, n: int, where: str) -> bytes:
    data = b""
    try:
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                break
            data += chunk
    except ssl.SSLError:  # the caller knows whether TLS was asked for and says what it means
        raise
    except OSError as exc:  # a fault (it may be restarting), not a refusal: the caller may retry
        raise SchedulerUnavailable(f"{where}: the handshake failed: {exc}") from None
    if len(data) < n:
        raise SchedulerUnavailable(f"{where} closed the connection during the handshake")
    return data


# --- where a scheduler without a secret may listen ---------------------------------------------


def is_loopback(host: str) -> bool:
    """True if every address `host` names is a loopback address (127.0.0.0/8, ::1)."""
    try:
        infos = socket.getaddrinfo(host, None)
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def listen_policy(host: str, secret: bytes | None, insecure: bool) -> bool:
    """May a scheduler listen on `host`? Without a secret only on loopback, unless TG_INSECURE=1; raises
    ConfigError naming the fix if not. True when it listens without authentication (worth a warning)."""
    if secret is not None:
        return False
    if insecure or is_loopback(host):
        return True
    raise ConfigError(f"the scheduler would listen on {host} without authentication: anyone who reaches that "
                      f"address could kill the job's processes or fail it. To fix it, {HINT}; or set TG_INSECURE=1 "
                      "on a network you trust")
