"""The scheduler's side of a TLS connection: one TLS session driven through memory BIOs, fed by the
connection's `data_received` (conn.py) and sending what it returns. Why not asyncio's own `start_tls`:
when it refuses a client's certificate it drops the connection without sending the TLS alert, so the
client only sees the connection close and cannot tell an expired certificate from a crashed scheduler.
Here the alert always goes out first (`outgoing()` after the error), and the client's message names the
cause (control/tls.py: ALERTS).
"""

from __future__ import annotations

import ssl

READ_CHUNK = 64 * 1024


class TLSSession:
    def __init__(self, context: ssl.SSLContext):
        self._incoming, self._outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._incoming, self._outgoing, server_side=True)
        self.established = False  # the handshake has finished

    def receive(self, data: bytes) -> bytes:
        """Take bytes from the network; return the plaintext they complete (b"" while the handshake runs).
        Raises ssl.SSLError for a refused handshake or a bad record (send `outgoing()` then: the alert), and
        EOFError when the peer has ended the session."""
        self._incoming.write(data)
        if not self.established:
            try:
                self._tls.do_handshake()
            except ssl.SSLWantReadError:
                return b""
            self.established = True
        plain = []
        while True:
            try:
                chunk = self._tls.read(READ_CHUNK)
            except ssl.SSLWantReadError:
                return b"".join(plain)
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                raise EOFError("the peer ended the TLS session") from None
            if not chunk:
                raise EOFError("the peer ended the TLS session")
            plain.append(chunk)

    def send(self, plain: bytes) -> bytes:
        """The bytes that carry `plain` (and anything the session had to send first)."""
        self._tls.write(plain)
        return self._outgoing.read()

    def outgoing(self) -> bytes:
        """What the session has to send now: its handshake messages, an alert, a TLS 1.3 key update."""
        return self._outgoing.read()
