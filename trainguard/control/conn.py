"""One connection to the scheduler, as an asyncio.Protocol: the TLS handshake where the job uses TLS, the
job-secret challenge (auth.py), then request frames, answered one at a time and in order.

Why a protocol and not asyncio's streams with a task per connection: at 10,000 workers the streams'
machinery (a task, a StreamReader, a future per read, a wake-up per step) was most of what the scheduler
spent on a registration storm. Here the bytes are parsed where they arrive, and a request whose handler
answers at once (register, heartbeat, host beat: all but join, agree and a store wait) is answered in
the same callback. Its reply still leaves only once the changes it may reveal are saved (commit.py).

What a stranger can do: hold a connection for TIMEOUT_S before it proves the secret (the owner caps how
many, per address and in all); send a frame the header refuses at once; hold a frame above
TIMED_FRAME_BYTES unfinished for FRAME_READ_TIMEOUT_S at most. While a request is in flight, or the
peer does not read its replies, at most READ_LIMIT bytes more are read from it.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import ssl
from functools import partial
from typing import Protocol

from ..errors import ProtocolError
from . import auth
from . import protocol as p
from .tls import refusal
from .tlsstream import TLSSession

log = logging.getLogger("trainguard.scheduler")

READ_LIMIT = 64 * 1024  # unread bytes held while a request is in flight; past it, reading pauses
FRAMES_PER_TURN = 64  # requests one connection has answered in a row before the loop serves the others
HANDLER_BUGS = (ValueError, TypeError, KeyError, OverflowError, ArithmeticError)  # a bug or a hostile value: answered


class Stage(enum.Enum):
    TLS = "the TLS handshake"
    CHALLENGE = "the job-secret challenge"
    FRAMES = "frames"
    CLOSED = "closed"


class Owner(Protocol):
    """What a connection needs from the scheduler."""

    def connection_opened(self, conn: SchedulerConnection) -> bool:
        """May it go on (the caps on connections)? False: it is closed at once."""

    def handshake_over(self, conn: SchedulerConnection, refused: str) -> None:
        """Once per opened connection, when its handshake ends: why it was refused, or "" (admitted, or
        closed by the scheduler itself)."""

    def request(self, req: p.Msg, conn: SchedulerConnection):
        """The reply, or an awaitable of it (a request that waits: join, agree, a store wait)."""

    def pending_commit(self) -> asyncio.Future | None:
        """The save that changes made so far wait for, if one is due (commit.py)."""

    def connection_closed(self, conn: SchedulerConnection) -> None:
        """Once, when the connection is gone."""


class SchedulerConnection(asyncio.Protocol):
    def __init__(self, owner: Owner, secret: bytes | None, tls_context: ssl.SSLContext | None):
        self.owner, self.secret, self.tls_context = owner, secret, tls_context
        self.peer: object = None
        self.address = ""
        self.agent = False  # it proved the job secret itself, or the job has none (auth.py)
        self.stage = Stage.CHALLENGE
        self._transport: asyncio.Transport | None = None
        self._tls: TLSSession | None = None
        self._nonce = b""
        self._buf = bytearray()  # received (with TLS: decrypted), not yet consumed
        self._timer: asyncio.TimerHandle | None = None  # the handshake's deadline, then a large frame's
        self._busy = False  # a request is being handled, or its reply waits for its save
        self._write_paused = False  # the transport's buffer is full: no new request until it drains
        self._read_paused = False
        self._turn_waits = False  # it answered FRAMES_PER_TURN in a row: the rest waits for its next turn
        self._opened = False
        self._closed_by_owner = False

    # --- asyncio's callbacks ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._transport = transport
        self.peer = transport.get_extra_info("peername")
        self.address = str(self.peer[0]) if isinstance(self.peer, tuple) else str(self.peer)
        if not self.owner.connection_opened(self):
            self.stage = Stage.CLOSED
            transport.close()
            return
        self._opened = True
        self._timer = asyncio.get_running_loop().call_later(auth.TIMEOUT_S, self._handshake_timeout)
        if self.tls_context is not None:
            self.stage = Stage.TLS
            self._tls = TLSSession(self.tls_context)
            transport.write(auth.TLS_GREETING)
        else:
            self._greet()

    def data_received(self, data: bytes) -> None:
        if self.stage is Stage.CLOSED:
            return
        if self._tls is not None:
            try:
                data = self._tls.receive(data)
            except ssl.SSLError as exc:
                self._transport.write(self._tls.outgoing())  # the alert: the client learns why
                if self.stage is Stage.FRAMES:  # a bad record: the session is broken, no frame can say why
                    log.warning("dropped connection from %s: TLS: %s", self.peer, exc)
                    self.stage = Stage.CLOSED
                    self._transport.close()
                else:
                    self._refuse(f"TLS: {refusal(exc)}")
                return
            except EOFError:
                self._transport.close()
                return
            if (out := self._tls.outgoing()):
                self._transport.write(out)
            if self.stage is Stage.TLS:
                if not self._tls.established:
                    return
                self._timer.cancel()  # the challenge gets its own TIMEOUT_S
                self._timer = asyncio.get_running_loop().call_later(auth.TIMEOUT_S, self._handshake_timeout)
                self._greet()
        self._buf += data
        self._process()

    def eof_received(self) -> bool:
        return False  # the transport closes; connection_lost follows

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._process()

    def connection_lost(self, exc: Exception | None) -> None:
        stage, self.stage = self.stage, Stage.CLOSED
        self._cancel_timer()
        if not self._opened:
            return
        if stage in (Stage.TLS, Stage.CHALLENGE):
            why = ("TLS: the TLS handshake did not finish (the connection closed)" if stage is Stage.TLS
                   else "no answer to the job-secret challenge")
            self.owner.handshake_over(self, "" if self._closed_by_owner else why)
        elif exc is not None:
            log.debug("connection from %s lost: %s", self.peer, exc)
        self.owner.connection_closed(self)

    # --- what the scheduler calls -------------------------------------------------------------------

    def close(self) -> None:
        """The scheduler ends the connection (the job is over): not a refusal."""
        self._closed_by_owner = True
        if self._transport is not None:
            self._transport.close()

    # --- the handshake -------------------------------------------------------------------------------

    def _greet(self) -> None:
        greeting, self._nonce = auth.hello(self.secret)
        self._send(greeting)
        if self.secret is None:
            self._admit(agent=True)
        else:
            self.stage = Stage.CHALLENGE

    def _admit(self, agent: bool) -> None:
        self._cancel_timer()
        self.agent, self.stage = agent, Stage.FRAMES
        self.owner.handshake_over(self, "")

    def _refuse(self, why: str) -> None:
        self._cancel_timer()
        self.stage = Stage.CLOSED
        self.owner.handshake_over(self, why)
        self._transport.close()  # what was written goes out first

    def _handshake_timeout(self) -> None:
        self._timer = None
        if self.stage is Stage.TLS:
            self._refuse(f"TLS: {refusal(TimeoutError())}")
        elif self.stage is Stage.CHALLENGE:
            self._refuse("no answer to the job-secret challenge")

    # --- frames ------------------------------------------------------------------------------------------

    def _process(self) -> None:
        """Handle what the buffer holds, in order, while nothing is in flight; after FRAMES_PER_TURN requests
        the rest waits for the loop's next pass, so a peer that pipelines a flood never holds up the others
        (their handshakes, their requests)."""
        if self._turn_waits:
            return
        buf = self._buf
        served = 0
        while not self._busy and not self._write_paused:
            if served >= FRAMES_PER_TURN and len(buf) >= p.HEADER.size:
                self._turn_waits = True
                asyncio.get_running_loop().call_soon(self._next_turn)
                break
            if self.stage is Stage.CHALLENGE:
                if len(buf) < auth.ANSWER_SIZE:
                    break
                answer = bytes(buf[:auth.ANSWER_SIZE])
                del buf[:auth.ANSWER_SIZE]
                verdict, agent = auth.judge(self.secret, self._nonce, answer)
                self._send(verdict)
                if verdict[0] != 1:
                    self._refuse("it does not hold the job secret")
                    return
                self._admit(agent)
                continue
            if self.stage is not Stage.FRAMES or len(buf) < p.HEADER.size:
                break
            try:
                length = p.parse_header(bytes(buf[:p.HEADER.size]), p.MAX_REQUEST_BYTES)
                end = p.HEADER.size + length
                if len(buf) < end:
                    if length > p.TIMED_FRAME_BYTES and self._timer is None:  # a large frame must arrive in time
                        self._timer = asyncio.get_running_loop().call_later(
                            p.FRAME_READ_TIMEOUT_S, self._frame_timeout, length)
                    break
                self._cancel_timer()
                payload = bytes(buf[p.HEADER.size:end])
                del buf[:end]
                req = p.decode_request(payload)
            except ProtocolError as exc:
                self._drop(str(exc))
                return
            self._dispatch(req)
            served += 1
        self._regulate_reading()

    def _next_turn(self) -> None:
        self._turn_waits = False
        if self.stage is not Stage.CLOSED:
            self._process()

    def _dispatch(self, req: p.Msg) -> None:
        self._busy = True
        try:
            reply = self.owner.request(req, self)
        except HANDLER_BUGS as exc:
            reply = self._bug(req, exc)
        if asyncio.iscoroutine(reply):
            asyncio.get_running_loop().create_task(reply).add_done_callback(partial(self._handled, req))
        else:
            self._answer(req, reply)

    def _handled(self, req: p.Msg, task: asyncio.Task) -> None:
        if task.cancelled():  # the scheduler is shutting down
            self._transport.close()
            return
        exc = task.exception()
        if exc is not None and not isinstance(exc, HANDLER_BUGS):
            log.error("%s request from %s failed", req.type, self.peer, exc_info=exc)
            self._transport.close()
            return
        self._answer(req, self._bug(req, exc) if exc is not None else task.result())
        self._process()

    def _bug(self, req: p.Msg, exc: BaseException) -> p.Error:
        log.error("%s request from %s failed: %r", req.type, self.peer, exc)  # a handler's bug, or a hostile value
        return p.Error(code=p.ErrorCode.BAD_MESSAGE, message=f"{req.type}: {type(exc).__name__}")

    def _answer(self, req: p.Msg, reply: p.Msg) -> None:
        """Send the reply once the changes it may reveal are saved (no reply reveals an unsaved change)."""
        try:
            try:
                data = p.encode(reply)
            except HANDLER_BUGS as exc:  # a hostile value the handler echoed
                data = p.encode(self._bug(req, exc))
        except ProtocolError as exc:
            self._drop(str(exc))
            return
        pending = self.owner.pending_commit()
        if pending is None:
            self._reply(data)
        else:
            pending.add_done_callback(partial(self._saved, data))

    def _saved(self, data: bytes, save: asyncio.Future) -> None:
        if save.cancelled() or save.exception() is not None:  # not saved (commit.py logged why): not acknowledged
            self._transport.close()
            return
        self._reply(data)
        self._process()

    def _reply(self, data: bytes) -> None:
        if self.stage is not Stage.CLOSED:
            self._send(data)
        self._busy = False

    def _frame_timeout(self, length: int) -> None:
        self._timer = None
        self._drop(f"a {length}-byte frame did not arrive within {p.FRAME_READ_TIMEOUT_S:g} s")

    def _drop(self, why: str) -> None:
        """A protocol error: say why, then close."""
        log.warning("dropped connection from %s: %s", self.peer, why)
        if self.stage is not Stage.CLOSED:
            self._send(p.encode(p.Error(code=p.ErrorCode.BAD_MESSAGE, message=why)))
            self.stage = Stage.CLOSED
        self._cancel_timer()
        self._transport.close()

    # --- plumbing --------------------------------------------------------------------------------------------

    def _send(self, data: bytes) -> None:
        self._transport.write(self._tls.send(data) if self._tls is not None else data)

    def _regulate_reading(self) -> None:
        if self.stage is Stage.CLOSED:
            return
        hold = len(self._buf) > READ_LIMIT and (self._busy or self._write_paused or self._turn_waits)
        if hold != self._read_paused:
            self._read_paused = hold
            (self._transport.pause_reading if hold else self._transport.resume_reading)()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
