"""The ROUTER socket's request path: drain, decode, hand to the service, reply.

A synchronous zmq ROUTER socket is driven by ``loop.add_reader`` on its FD (faster here
than zmq.asyncio); the FD is edge-triggered, so the socket is drained until EVENTS has
no POLLIN, and again after every send.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
import zmq

from kvd.access import UNKNOWN_PEER, Peer, peer_address
from kvd.config import Config
from kvd.service import Service
from kvd.socket_file import SocketFile
from kvd_proto import messages as m

log = logging.getLogger("kvd.server")
# Per connection: replies and Dones queued for a client that does not read them (then it
# is dropped: it registers again once it reads), and messages taken in ahead of the loop
# (then its sends wait, and its own queue of 1,000 fills: calls fail at once there).
SEND_HWM = 4096
RECV_HWM = 1000
DRAIN_BATCH = 256  # messages per turn of the loop: completions and timers run between
# Plain ints: pyzmq's enum members cost an object per operation on the hot path.
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)
_MORE = _NOBLOCK | int(zmq.SNDMORE)


def _reply(sock: zmq.Socket, identity: bytes, reply: m.Reply) -> None:
    """Two sends with int flags: a third of ``send_multipart``'s cost (its enum flags
    and checks are Python). Encoded first, so the identity frame never goes out alone;
    a reply to a peer that is gone is dropped whole (EHOSTUNREACH); ``zmq.Again``: the
    peer's queue is full (it does not read)."""
    data = m.encode(reply)
    sock.send(identity, _MORE)
    sock.send(data, _NOBLOCK)


def router_socket(ctx: zmq.Context, config: Config) -> zmq.Socket:
    """The daemon's ROUTER socket, not bound yet (``SocketFile.bind``)."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    # A client is its connection: Hello checked that peer's credentials, and a second
    # connection claiming the same routing id must not inherit them (with handover it
    # would take over the client, its memory and leases, unchecked).
    sock.setsockopt(zmq.ROUTER_HANDOVER, 0)
    # The hard cap drops the connection; below it, oversize gets a typed error.
    sock.setsockopt(zmq.MAXMSGSIZE, 2 * config.max_message_bytes)
    sock.setsockopt(zmq.SNDHWM, SEND_HWM)
    sock.setsockopt(zmq.RCVHWM, RECV_HWM)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full queue raises, not drops
    return sock


class Router:
    """Answers what arrives on ``sock`` through ``service``; the server owns the
    socket's start and stop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: zmq.Socket, service: Service,
                 socket_file: SocketFile) -> None:
        self.loop = loop
        self.sock = sock
        self.service = service
        self.socket_file = socket_file

    def send(self, identity: bytes, reply: m.Reply) -> None:
        """A reply or Done sent outside a drain (the service's ``send``)."""
        self.reply(identity, reply)
        self.loop.call_soon(self.drain)  # sending can swallow the FD's edge

    def reply(self, identity: bytes, reply: m.Reply) -> None:
        try:
            _reply(self.sock, identity, reply)
        except zmq.Again:  # SEND_HWM replies wait for it: a client that does not read
            self.service.client_gone(identity, f"does not read its replies ({SEND_HWM} "
                                               "queued): dropped; it registers again")
        except zmq.ZMQError as e:
            log.debug("reply to a vanished peer dropped: %s", e)

    def drain(self) -> None:
        """Up to DRAIN_BATCH messages, then the rest at the loop's next turn: a client
        that floods the socket must not hold up other clients' Dones and the timers."""
        sock = self.sock
        if sock.closed:  # queued by a late Done before the stop closed it
            return
        for _ in range(DRAIN_BATCH):
            if not sock.get(_EVENTS) & _POLLIN:
                break
            try:  # two recvs: a third of recv_multipart's cost (its RCVMORE checks)
                identity = sock.recv(_NOBLOCK)
                frame = sock.recv(_NOBLOCK, copy=False)
                part, extra = frame, 0
                while part.more:  # a message of several frames: read whole, refused
                    part = sock.recv(_NOBLOCK, copy=False)
                    extra += 1
            except zmq.Again:
                break
            try:
                reply = self._answer(identity, frame, extra)
            except Exception as e:  # noqa: BLE001 - the drain loop must never stop early
                log.exception("internal error")
                reply = self.service.error(0, m.Code.INTERNAL, f"internal error: {e}")
            if reply is not None:
                self.reply(identity, reply)
        else:  # the batch is full: more may wait (the FD signals no edge for them)
            self.loop.call_soon(self.drain)
        try:
            self.service.idle()  # bookkeeping that need not delay the replies
        except Exception:  # noqa: BLE001
            log.exception("idle work failed")

    def _answer(self, identity: bytes, frame: zmq.Frame, extra: int) -> m.Reply | None:
        service = self.service
        if extra:
            return service.error(0, m.Code.BAD_REQUEST, f"expected 1 frame, got {1 + extra}")
        data = frame.buffer
        if len(data) > service.config.max_message_bytes:
            self._heard(identity, frame)
            return service.error(m.peek_req(data), m.Code.BAD_REQUEST,
                                 f"message of {len(data)} bytes exceeds max_message_bytes")
        try:
            msg = m.decode_request(data)
        except (msgspec.MsgspecError, ValueError) as e:
            self._heard(identity, frame)
            return service.error(m.peek_req(data), m.Code.BAD_REQUEST,
                                 f"malformed message: {e}")
        try:
            client = service.clients.get(identity)
            if client is not None and client.address \
                    and peer_address(frame) != client.address:
                # Another connection with a closed one's routing id (its client not yet
                # timed out): it is not that client, and never gets its memory or leases.
                return service.error(getattr(msg, "req", 0), m.Code.NOT_REGISTERED,
                                     "this connection is not the one that said Hello")
            if isinstance(msg, m.Transfer):  # the data path: straight to its owner
                return service.transfers.handle(identity, msg)
            peer = UNKNOWN_PEER
            if isinstance(msg, m.Hello):  # a new connection: one descriptor more
                self.socket_file.guard()
                peer = Peer.of(frame)
            return service.handle(identity, peer, msg)
        except Exception as e:  # noqa: BLE001 - no input may crash the daemon
            log.exception("internal error on %s", type(msg).__name__)
            return service.error(getattr(msg, "req", 0), m.Code.INTERNAL,
                                 f"internal error: {e}")

    def _heard(self, identity: bytes, frame: zmq.Frame) -> None:
        """A message this daemon cannot read (a newer client's) is still a sign of life:
        each gets an Error, which keeps the client from pinging, so a client whose
        traffic is such messages was dropped as silent."""
        client = self.service.clients.get(identity)
        if client is not None and (not client.address or peer_address(frame) == client.address):
            client.last_seen = self.service.clock()
