"""The wire protocol between kvd and its clients: one msgspec Struct per message.

Every message is a frozen, array-like, tagged Struct encoded with MessagePack. The wire
only grows: a new field goes at the end with a default, a tag is never reused, and
PROTOCOL_VERSION changes only when an old peer could misread a new message.

Requests carry ``req`` (the client's request id); every reply echoes it. A Transfer is
answered by exactly one Done, pushed when the copy finished (or failed). Block and slot
ids are packed little-endian uint32 bytes (see ``kvd_proto.ids``); keys are vLLM's
OffloadKey bytes (block hash + 4-byte group index), opaque to kvd.
"""

from __future__ import annotations

import enum

import msgspec

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# A Transfer's deadline is the last instant (CLOCK_MONOTONIC, the clock every process of
# a node shares) at which the daemon may *start* a copy for it. A copy started just
# before it ends within this grace, or its result is thrown away (a store commits
# nothing). A client may therefore treat a Transfer as failed, and reuse its memory,
# once deadline + EXPIRY_GRACE_NS has passed without a Done.
EXPIRY_GRACE_NS = 1_000_000_000


class Code(enum.IntEnum):
    """Error codes, sorted by what the caller should do next."""

    OK = 0
    # The request was wrong: fix the caller, retrying will not help.
    BAD_REQUEST = 1
    VERSION_MISMATCH = 2
    NOT_REGISTERED = 3  # Hello/Register first (e.g. after a daemon restart)
    BAD_IDS = 4  # block or slot ids out of range, foreign, or in the wrong state
    SIZE_MISMATCH = 5
    # The daemon cannot do it now: degrade (miss / skip the store), maybe retry later.
    NO_SPACE = 10
    BUSY = 11
    # The copy itself failed.
    TRANSFER_FAILED = 20
    PERMISSION = 21  # the daemon may not read/write the client's memory
    CLIENT_GONE = 22
    ABORTED = 23
    CHECKSUM = 24
    # The Transfer's deadline passed before the copy could start: nothing was copied
    # (a store's slots were given up, a load wrote nothing into the client's memory).
    EXPIRED = 25
    # Access control.
    FORBIDDEN = 30
    INTERNAL = 99


class Direction(enum.IntEnum):
    STORE = 0  # client memory -> pool
    LOAD = 1  # pool -> client memory


class _Msg(msgspec.Struct, frozen=True, array_like=True, tag=True, omit_defaults=False):
    pass


# ---------------------------------------------------------------- handshake


class Hello(_Msg, tag="hello"):
    req: int
    version: int
    pid: int
    name: str = ""


class HelloOk(_Msg, tag="hello_ok"):
    req: int
    version: int
    daemon_pid: int
    instance: str  # changes on every daemon start: a client re-registers when it does
    client_id: int
    # The client's pid as the daemon sees it: equal to the client's own pid exactly when
    # both share a PID namespace, so ``daemon_pid`` names the daemon for the client too.
    peer_pid: int = 0
    # The daemon's CLOCK_MONOTONIC as it answered (0: not said). Transfer deadlines are
    # on that clock: a client in another time namespace reads it offset, and must not
    # send them (the daemon would copy past them, or expire every one).
    monotonic_ns: int = 0


class Fingerprint(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """What makes blocks interchangeable between engines (the tenant).

    The one struct that does not take unknown trailing fields: a field a newer client
    added to tell tenants apart would be dropped by an older daemon, which would then
    merge two tenants and serve one's blocks to the other. It refuses the Register
    instead (the client runs without kvd). New identity goes into ``extra``."""

    model: str
    dtype: str
    kv_dtype: str
    block_tokens: int
    tp_size: int
    rank_page_bytes: list[int]  # per-rank bytes of one block, per tensor (layer)
    hash_algo: str
    root_hash: bytes
    pp_rank: int = 0
    extra: str = ""


class HostRegion(msgspec.Struct, frozen=True, array_like=True):
    """One KV tensor in the client's address space: block b lives at base + b * stride."""

    base: int
    num_blocks: int
    stride: int
    page_bytes: int


class CudaRegion(msgspec.Struct, frozen=True, array_like=True):
    """One KV tensor in GPU memory, exported with a legacy CUDA IPC handle."""

    device_uuid: bytes
    ipc_handle: bytes  # 64 bytes, for the allocation base
    offset: int  # tensor start minus allocation base
    num_blocks: int
    stride: int
    page_bytes: int


class Register(_Msg, tag="register"):
    """Join a tenant. ``rank`` -1 is the scheduler side (index only, no memory)."""

    req: int
    fingerprint: Fingerprint
    rank: int = -1
    host_regions: list[HostRegion] = []
    cuda_regions: list[CudaRegion] = []
    cuda_event_handles: list[bytes] = []
    # The client cannot export its GPU memory (expandable segments, sleep mode, MIG, PID
    # namespace): it maps the pool and copies itself; its Transfers report finished copies.
    client_copy: bool = False
    client_copy_reason: str = ""


class Registered(_Msg, tag="registered"):
    req: int
    tenant_id: int
    slot_bytes: int  # one block for all ranks
    rank_bytes: int  # one rank's share of a slot
    # For client_copy: slot s is at (s // slots_per_extent) * extent_bytes
    # + (s % slots_per_extent) * slot_bytes in the pool file.
    pool_path: str = ""
    extent_bytes: int = 0
    slots_per_extent: int = 0


# ---------------------------------------------------------------- index


class Lookup(_Msg, tag="lookup"):
    """Length of the leading READY run of ``keys``; leases the hit blocks."""

    req: int
    keys: list[bytes]
    lease_ms: int = 30_000
    depth: int = 0  # prefix position of keys[0] (block index in the request)


class LookupOk(_Msg, tag="lookup_ok"):
    req: int
    hits: int  # keys[:hits] are READY and leased
    slots: bytes  # packed slot ids of those hits
    lease: int  # lease id (0 when hits == 0)
    pending: int = 0  # keys[hits:hits+pending] are being stored right now


class Release(_Msg, tag="release"):
    """Drop a lease (all of it, or only the blocks in ``slots``)."""

    req: int
    lease: int
    slots: bytes = b""


class Allocate(_Msg, tag="allocate"):
    """Reserve slots for keys not stored yet; they stay PENDING until every rank stored.

    A nonzero ``ticket`` (chosen by the client, unique within its tenant) also keeps the
    slots under that number, so workers can store with ``Transfer.ticket`` without
    waiting for the reply to travel through the engine."""

    req: int
    keys: list[bytes]
    depth: int = 0
    pending_ms: int = 60_000
    ticket: int = 0
    # Blocks in the whole request when known (0: depth + len(keys)). vLLM stores a long
    # prompt in parts, one per step; the policy keeps them one run of that length.
    length: int = 0
    # The key before keys[0] in the request's chain (empty: keys[0] starts it, or the
    # sender does not know): the parent the KV events give the first stored block.
    parent: bytes = b""
    # False: the keys are not one run of consecutive blocks (vLLM skips blocks of a
    # sliding-window group), so none is the parent of the next.
    chained: bool = True


class Allocated(_Msg, tag="allocated"):
    req: int
    slots: bytes  # packed, one per key; NO_SLOT where the key is stored already
    evicted: list[bytes]  # keys evicted to make room
    allocated: int = 0  # keys[:allocated] got an answer; the rest did not fit
    # Packed uint32 per slot (0 for NO_SLOT): the slot's allocation number, which a
    # store naming these slots sends back (``Transfer.gens``).
    gens: bytes = b""


# ---------------------------------------------------------------- data


class Transfer(_Msg, tag="transfer"):
    """Copy blocks between the sender's registered memory and pool slots.

    A store may name an Allocate's ``ticket`` instead of slots: ``block_ids`` then
    follow that Allocate's keys, and blocks whose key got no slot are skipped."""

    req: int
    event: int
    direction: Direction
    block_ids: bytes  # packed engine block ids
    slots: bytes  # packed slot ids, same length (empty with a ticket)
    cuda_event: int = -1  # index in the registered event ring (stores on GPU)
    ticket: int = 0
    deadline_ns: int = 0  # CLOCK_MONOTONIC ns; no copy starts after it (0: none)
    # A load may name the Lookup lease its slots came from: refused once the lease is
    # gone (lapsed, released, dropped with its connection, or of another daemon run),
    # when the slots may hold other blocks.
    lease: int = 0
    # A store that names slots (no ticket) should send back their ``Allocated.gens``: a
    # slot given up (aborted, expired) and handed out again since is then refused
    # instead of written with another key's bytes (empty: the sender is trusted).
    gens: bytes = b""


class Done(_Msg, tag="done"):
    """Pushed once per Transfer when it finished."""

    req: int
    event: int
    code: Code = Code.OK
    message: str = ""
    nbytes: int = 0
    seconds: float = 0.0


class EventWaited(_Msg, tag="event_waited"):
    """Pushed when the daemon's wait on the CUDA event a transfer named passed: from now
    on the client may record that event again. Always before the Transfer's Done."""

    req: int
    event: int
    cuda_event: int


class Abort(_Msg, tag="abort"):
    """Give up PENDING slots that will never be stored (the request went away)."""

    req: int
    slots: bytes


# ---------------------------------------------------------------- admin


class Stats(_Msg, tag="stats"):
    req: int


class StatsOk(_Msg, tag="stats_ok"):
    req: int
    status: bytes  # JSON document, schema in kvd.status (kept open for growth)


class Evict(_Msg, tag="evict"):
    """Admin: drop READY unpinned blocks of one tenant, or of all when tenant is -1."""

    req: int
    tenant: int = -1


class Flush(_Msg, tag="flush"):
    """Admin: empty the cache, like memcached's flush_all: drop every READY unpinned block
    of every tenant. Leased, in-flight and PENDING blocks stay. Answered with Ok(count)."""

    req: int


class GetConfig(_Msg, tag="get_config"):
    """Admin: the daemon's effective configuration and where each value came from."""

    req: int


class Reload(_Msg, tag="reload"):
    """Admin: re-read the configuration as SIGHUP does; answered with Reloaded once it is
    applied, or an Error once it is refused (so ``systemctl reload`` can wait for it)."""

    req: int


class Reloaded(_Msg, tag="reloaded"):
    req: int
    summary: str  # what changed, and what needs a restart (the daemon's log line)


class ConfigOk(_Msg, tag="config_ok"):
    req: int
    values: bytes  # JSON object: key -> effective value
    origins: dict[str, str]  # key -> "default" | "file <path>" | "env" | "flag"


class Ping(_Msg, tag="ping"):
    """Liveness probe; answered with Ok. Cheap enough to send every second."""

    req: int


class Bye(_Msg, tag="bye"):
    """The client closes this connection: the daemon releases its leases and pending
    stores now, not after ``client_timeout_ms``. Not answered. (A daemon older than
    this message answers an Error to nobody.)"""

    req: int


class Ok(_Msg, tag="ok"):
    req: int
    count: int = 0


class Error(_Msg, tag="error"):
    req: int
    code: Code
    message: str


Request = (
    Hello | Register | Lookup | Release | Allocate | Transfer | Abort | Stats | Evict | Ping
    | Flush | GetConfig | Bye | Reload
)
Reply = (HelloOk | Registered | LookupOk | Allocated | Done | StatsOk | Ok | Error
         | EventWaited | ConfigOk | Reloaded)

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)

encode = _encoder.encode


def decode_request(data: bytes | memoryview) -> Request:
    """Decode one request; raises msgspec.DecodeError on any bad input."""
    try:
        return _request_decoder.decode(data)
    except UnicodeDecodeError as e:  # msgspec lets this one through for str fields
        raise msgspec.DecodeError(f"invalid UTF-8: {e}") from None


def decode_reply(data: bytes | memoryview) -> Reply:
    try:
        return _reply_decoder.decode(data)
    except UnicodeDecodeError as e:
        raise msgspec.DecodeError(f"invalid UTF-8: {e}") from None


def peek(data: bytes | memoryview) -> tuple[str, int]:
    """Best-effort type and request id of an undecodable message ("" and 0 where it
    does not even say), so its error can be matched."""
    try:
        raw = msgspec.msgpack.decode(data)
    except Exception:  # noqa: BLE001 - garbage has neither
        return "", 0
    if not isinstance(raw, list) or not raw:
        return "", 0
    tag = raw[0] if isinstance(raw[0], str) else ""
    req = raw[1] if len(raw) > 1 and isinstance(raw[1], int) and 0 <= raw[1] < 2**63 else 0
    return tag, req


def peek_req(data: bytes | memoryview) -> int:
    return peek(data)[1]
