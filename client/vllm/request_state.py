"""One request's lookup state, and the leases the daemon holds on its behalf.

Apart from the manager so that the manager reads as vLLM's hooks and the lookup's
steps, while what a request holds in kvd (a lease on its hit blocks, a Lookup reply on
its way) and how that is let go when the request ends, is given up on, or is dropped,
lives in one place. Scheduler thread only.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from vllm.v1.kv_offload.base import ReqContext

from kvd_client.connection import Connection
from kvd_proto import messages as m

COLLECT, WAIT, ANSWERED = "collect", "wait", "answered"


@dataclass(eq=False)
class ReqState:
    """One request's lookup state (scheduler thread only)."""

    ctx: ReqContext
    first_seen: float
    phase: str = COLLECT
    keys: dict[bytes, None] = field(default_factory=dict)  # the scan being collected
    sent: list[bytes] = field(default_factory=list)
    future: Future | None = None
    deadline: float = 0.0
    hits: dict[bytes, int] = field(default_factory=dict)  # key -> slot (leased)
    pending: frozenset[bytes] = frozenset()
    answered: frozenset[bytes] = frozenset()  # keys the reply speaks for (hits, pending, first miss)
    asked_again: int = 0  # new Lookups for keys past an earlier reply
    gave_up: bool = False  # no usable reply (deadline, error): the rest is a miss
    lease: int = 0
    lease_until: float = 0.0
    epoch: int = 0  # the connection's registration the Lookup went out on
    instance: str = ""
    refresh: bool = False  # answered HIT_PENDING: ask again at the end of the step
    served: bool = False  # the current reply answered a HIT (its lease was live then)
    loaded: bool = False


class Leases:
    """What kvd holds for the manager's requests, and its release.

    Lookups in flight (``waiting``), and requests that ended with a load still out
    (``ended_loading``, see ``end``). A reply that comes after its request gave up on
    it is the connection's to release (``abandon``).
    """

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.waiting = 0  # Lookups in flight
        self.ended_loading: dict[str, ReqState] = {}  # ended with a load out (``end``)

    def end(self, st: ReqState) -> None:
        """A request ended. One whose load was handed to the workers keeps its lease until
        that load's complete_load, which vLLM still calls after the end (an aborted
        request's load leaves in the very step that ends it): released now, the load's
        Transfer would find the lease gone and fail. Kept at most until the lease's own
        margin runs out (the manager's ``_schedule_end``), should complete_load never
        come."""
        if st.loaded and st.lease and st.future is None and st.lease_until > time.monotonic():
            self.ended_loading[st.ctx.req_id] = st
        else:
            self.drop(st)

    def drop(self, st: ReqState) -> None:
        self.release(st)
        if st.future is not None:
            self.abandon(st)

    def release(self, st: ReqState) -> None:
        lease, st.lease, st.hits, st.pending = st.lease, 0, {}, frozenset()
        if lease and self.conn.up and st.instance == self.conn.instance:
            self.conn.submit(m.Release(self.conn.next_req(), lease))  # fire and forget

    def abandon(self, st: ReqState) -> None:
        """The request no longer waits for its Lookup reply: a lease in it goes back to
        the daemon run the Lookup went to, from the connection's I/O thread as it comes
        (held for the next scheduler step, it kept an idle engine stepping until then)."""
        assert st.future is not None
        self.conn.give_up(st.future)
        self.waiting -= 1
        st.future = None
        st.hits, st.pending = {}, frozenset()
