"""Who may talk to the scheduler: a challenge-response handshake on the job's shared secret.

Every connection starts with it, before any frame. The scheduler speaks first:

    scheduler -> client   b"TGA" | version | mode (0 open, 1 secret) | nonce_s (32 random bytes)
    client -> scheduler   nonce_c (32 random bytes) | HMAC-SHA256(secret, b"TG-client" nonce_s nonce_c)
    scheduler -> client   ok (1 byte: 1 or 0) | HMAC-SHA256(secret, b"TG-server" nonce_s nonce_c)

Both sides prove they know the secret without sending it, and fresh nonces on both sides make a
recorded handshake worthless. The client checks the scheduler's proof too, so an agent obeys
placement orders, and a worker its rank, only from the real scheduler. A client that holds a
secret refuses a scheduler that does not ask for one (a stranger posing as it). Why a handshake
and not an HMAC on every frame or TLS-PSK: the frames then cost nothing more (a heartbeat is one
round trip, bench/control_plane.py), and Python's ssl has PSK only from 3.13. What it does not do:
hide or protect the frames of an established connection from someone on the network path (TLS
does that), nor touch gloo's traffic between workers (README, "Security").
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import os
import socket

from ..errors import AuthenticationFailed, ConfigError, SchedulerUnavailable

MAGIC = b"TGA"
VERSION = 1
NONCE = 32
HELLO_SIZE = len(MAGIC) + 2 + NONCE
ANSWER_SIZE = NONCE + 32
VERDICT_SIZE = 1 + 32
TIMEOUT_S = 5.0  # a client that has not answered the challenge by then is dropped
HINT = ("give every process of the job the same secret: TG_JOB_SECRET_FILE=path (or TG_JOB_SECRET); "
        "`trainguard run` writes its own to <recovery path>/job.secret")


def proof(secret: bytes, side: bytes, nonce_s: bytes, nonce_c: bytes) -> bytes:
    return hmac.new(secret, b"TG-" + side + nonce_s + nonce_c, hashlib.sha256).digest()


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


async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: bytes | None) -> str:
    """The scheduler's side on a new connection: "" if the peer may send frames, else why it may not."""
    greeting, nonce_s = hello(secret)
    writer.write(greeting)
    await writer.drain()
    if secret is None:
        return ""
    try:
        answer = await asyncio.wait_for(reader.readexactly(ANSWER_SIZE), TIMEOUT_S)
    except (asyncio.TimeoutError, asyncio.IncompleteReadError):
        return "no answer to the job-secret challenge"
    verdict = check_answer(secret, nonce_s, answer)
    writer.write(verdict)
    await writer.drain()
    return "" if verdict[0] == 1 else "it does not hold the job secret"


def client_handshake(sock: socket.socket, secret: bytes | None, where: str) -> None:
    """Run the client's side on a fresh connection; AuthenticationFailed says what is wrong and how to fix it."""
    head = _recv(sock, HELLO_SIZE, where)
    if head[:len(MAGIC)] != MAGIC or head[len(MAGIC)] != VERSION:
        raise AuthenticationFailed(f"{where} did not greet as a trainguard scheduler of this version")
    mode, nonce_s = head[len(MAGIC) + 1], head[len(MAGIC) + 2:]
    if mode == 0:
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
