"""The scheduler's side of a TLS connection: one TLS session over an asyncio stream, driven through memory
BIOs. Why not asyncio's own `start_tls`: when it refuses a client's certificate it drops the connection
without sending the TLS alert, so the client only sees the connection close and cannot tell an expired
certificate from a crashed scheduler. Here the alert always goes out first, and the client's message
names the cause (control/tls.py: ALERTS).

It offers the few stream methods the scheduler uses: `readexactly`, `write`, `drain`, `close`,
`get_extra_info`.
"""

from __future__ import annotations

import asyncio
import ssl

READ_CHUNK = 64 * 1024


class TLSStream:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, context: ssl.SSLContext):
        self._incoming, self._outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._incoming, self._outgoing, server_side=True)
        self._reader, self._writer = reader, writer
        self._plain = bytearray()  # decrypted, not yet consumed

    async def handshake(self, timeout: float) -> None:
        """Raises ssl.SSLError (after sending the alert that says why), TimeoutError or ConnectionError."""
        async with asyncio.timeout(timeout):
            while True:
                try:
                    self._tls.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    self._flush()
                    await self._feed()
                except ssl.SSLError:
                    self._flush()  # the alert: the client learns why
                    try:
                        await self._writer.drain()
                    except ConnectionError:
                        pass
                    raise
        self._flush()
        await self._writer.drain()

    async def readexactly(self, n: int) -> bytes:
        while len(self._plain) < n:
            try:
                chunk = self._tls.read(max(n - len(self._plain), READ_CHUNK))
            except ssl.SSLWantReadError:
                self._flush()  # TLS 1.3 may answer (a key update) before reading on
                await self._feed(partial=bytes(self._plain), wanted=n)
                continue
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):  # the peer ended the session
                chunk = b""
            if not chunk:
                raise asyncio.IncompleteReadError(bytes(self._plain), n)
            self._plain += chunk
        data = bytes(self._plain[:n])
        del self._plain[:n]
        return data

    def write(self, data: bytes) -> None:
        self._tls.write(data)
        self._flush()

    async def drain(self) -> None:
        await self._writer.drain()

    def close(self) -> None:
        self._writer.close()

    def get_extra_info(self, name: str, default=None):
        if name == "peercert":
            return self._tls.getpeercert()
        return self._writer.get_extra_info(name, default)

    def _flush(self) -> None:
        data = self._outgoing.read()
        if data:
            self._writer.write(data)

    async def _feed(self, partial: bytes = b"", wanted: int | None = None) -> None:
        data = await self._reader.read(READ_CHUNK)
        if not data:
            raise asyncio.IncompleteReadError(partial, wanted)
        self._incoming.write(data)
