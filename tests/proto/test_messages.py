"""The wire format is a contract: golden bytes, round trips, and only-grows rules."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from kvd_proto import messages as m
from kvd_proto.ids import pack_u32, unpack_u32



def test_golden_bytes_of_core_messages():
    # Regenerate deliberately only when PROTOCOL_VERSION changes.
    assert m.encode(m.Hello(1, 1, 42, "w")).hex() == "95a568656c6c6f01012aa177"
    assert m.encode(m.Lookup(7, [b"\x01\x02"], 1000, 3)).hex() == (
        "95a66c6f6f6b757007" "91c4020102" "cd03e8" "03")
    assert m.encode(m.Done(9, 5)).hex() == (
        "97a4646f6e65" "0905" "00" "a0" "00" "cb0000000000000000")
    t = m.Transfer(9, 5, m.Direction.LOAD, pack_u32([1, 2]), pack_u32([3]))
    assert m.encode(t).hex() == (
        "9ba87472616e73666572" "09" "05" "01" "c4080100000002000000" "c40403000000" "ff"
        "00"  # ticket, appended in the same protocol version (the wire only grows)
        "00"  # deadline_ns, appended the same way
        "00"  # lease, appended the same way
        "c400")  # gens, appended the same way
    assert m.encode(m.Bye(0)).hex() == "92a362796500"
    assert m.encode(m.Reload(3)).hex() == "92a672656c6f616403"  # added in protocol 1
    assert m.encode(m.Reloaded(3, "ok")).hex() == (
        "93a872656c6f61646564" "03" "a26f6b")


@pytest.mark.parametrize("msg", [
    m.Hello(1, m.PROTOCOL_VERSION, 10, "x"),
    m.Register(2, m.Fingerprint("m", "bf16", "bf16", 16, 2, [4096, 8192], "sha256", b"r"), 1,
               [m.HostRegion(1 << 40, 10, 8192, 4096)]),
    m.Lookup(3, [b"a" * 36, b"b" * 36]),
    m.Allocate(4, [b"a"], 2, 1000), m.Allocate(4, [b"a"], 2, 1000, 9, 30),
    m.Transfer(5, 1, m.Direction.STORE, pack_u32([1]), pack_u32([2]), 3),
    m.Release(6, 99), m.Abort(7, pack_u32([1])), m.Stats(8), m.Evict(9, -1), m.Ping(10),
    m.Bye(11), m.Reload(12),
])
def test_requests_round_trip(msg):
    assert m.decode_request(m.encode(msg)) == msg


@pytest.mark.parametrize("msg", [
    m.HelloOk(1, 1, 2, "inst", 3), m.Registered(2, 1, 8192, 4096),
    m.LookupOk(3, 2, pack_u32([1, 2]), 5, 1), m.Allocated(4, pack_u32([1]), [b"k"], 1),
    m.Done(5, 1, m.Code.CHECKSUM, "bad", 0, 0.5), m.StatsOk(6, b"{}"), m.Ok(7, 1),
    m.Error(8, m.Code.NO_SPACE, "full"), m.Reloaded(9, "reloaded x 1 -> 2"),
])
def test_replies_round_trip(msg):
    assert m.decode_reply(m.encode(msg)) == msg


def test_tags_are_unique_and_every_message_has_a_request_id():
    structs = [t for t in m.Request.__args__ + m.Reply.__args__]
    tags = [t.__struct_config__.tag for t in structs]
    assert len(tags) == len(set(tags))
    assert all(t.__struct_fields__[0] == "req" for t in structs)


def test_an_older_message_without_new_trailing_fields_still_decodes():
    # A peer that predates Lookup.depth sends four fields; the default fills the fifth.
    old = msgspec.msgpack.encode(["lookup", 3, [b"k"], 500])
    assert m.decode_request(old) == m.Lookup(3, [b"k"], 500, 0)


def test_a_fingerprint_with_a_field_this_daemon_does_not_know_is_refused():
    # Dropping it could merge two tenants a newer client tells apart: refused, not read.
    fp = ["m", "bf16", "auto", 16, 1, [4096], "sha256", b"r", 0, "", "new-identity"]
    with pytest.raises(msgspec.ValidationError):
        m.decode_request(msgspec.msgpack.encode(["register", 1, fp, -1]))
    assert m.decode_request(msgspec.msgpack.encode(["register", 1, fp[:-1], -1])
                            ).fingerprint.model == "m"


def test_ticket_fields_grow_the_wire_both_ways():
    # A client from before tickets: its Transfer and Allocate decode with ticket 0.
    old_transfer = msgspec.msgpack.encode(["transfer", 9, 5, 0, b"", b"", -1])
    assert m.decode_request(old_transfer).ticket == 0
    assert m.decode_request(msgspec.msgpack.encode(["allocate", 4, [b"k"], 0, 10])).ticket == 0
    # ... and from before Allocate.length: 0, the daemon then takes depth + len(keys).
    assert m.decode_request(msgspec.msgpack.encode(["allocate", 4, [b"k"], 0, 10, 7])
                            ).length == 0

    # A daemon from before tickets ignores the trailing field it does not know.
    class OldTransfer(msgspec.Struct, array_like=True, tag="transfer", frozen=True):
        req: int
        event: int
        direction: int
        block_ids: bytes
        slots: bytes
        cuda_event: int = -1

    new = m.Transfer(9, 5, m.Direction.STORE, pack_u32([1]), b"", -1, 77)
    assert msgspec.msgpack.decode(m.encode(new), type=OldTransfer).event == 5


def test_deadline_and_peer_pid_grow_the_wire_both_ways():
    # A client from before deadlines: its Transfer decodes with "no deadline".
    old = msgspec.msgpack.encode(["transfer", 9, 5, 0, b"", b"", -1, 0])
    assert m.decode_request(old).deadline_ns == 0
    old_hello_ok = msgspec.msgpack.encode(["hello_ok", 1, 1, 2, "inst", 3])
    assert m.decode_reply(old_hello_ok).peer_pid == 0

    class OldTransfer(msgspec.Struct, array_like=True, tag="transfer", frozen=True):
        req: int
        event: int
        direction: int
        block_ids: bytes
        slots: bytes
        cuda_event: int = -1
        ticket: int = 0

    new = m.Transfer(9, 5, m.Direction.STORE, pack_u32([1]), b"", -1, 77, 123_456_789)
    assert msgspec.msgpack.decode(m.encode(new), type=OldTransfer).ticket == 77
    assert m.decode_request(m.encode(new)).deadline_ns == 123_456_789


def test_a_loads_lease_grows_the_wire_both_ways():
    # A client from before leased loads: its Transfer decodes with "no lease named".
    old = msgspec.msgpack.encode(["transfer", 9, 5, 1, b"", b"", -1, 0, 0])
    assert m.decode_request(old).lease == 0

    # A daemon from before: every Transfer field up to deadline_ns, none after.
    fields = [(f.name, f.type, f.default) for f in msgspec.structs.fields(m.Transfer)]
    upto = [f[0] for f in fields].index("deadline_ns") + 1
    OldTransfer = msgspec.defstruct("OldTransfer", fields[:upto], array_like=True,
                                    tag="transfer")
    new = m.Transfer(9, 5, m.Direction.LOAD, pack_u32([1]), pack_u32([2]), -1, 0, 7,
                     lease=1 << 50)
    assert msgspec.msgpack.decode(m.encode(new), type=OldTransfer).deadline_ns == 7
    assert m.decode_request(m.encode(new)).lease == 1 << 50


def test_packed_ids():
    ids = np.array([0, 1, 0xFFFFFFFF], dtype=np.uint64)
    assert unpack_u32(pack_u32(ids)).tolist() == ids.tolist()
    with pytest.raises(ValueError):
        pack_u32([-1])
    with pytest.raises(ValueError):
        unpack_u32(b"\x00\x01\x02")


def test_bad_input_raises_decode_errors_not_crashes():
    for data in (b"", b"\xc1", b"\x92\xa5hello\x01", m.encode(m.Ping(1))[:-1]):
        with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
            m.decode_request(data)
    assert m.peek_req(m.encode(m.Lookup(77, [b"k"]))[:-1]) == 0
    assert m.peek_req(m.encode(m.Lookup(77, [b"k"]))) == 77


def test_store_gens_grow_the_wire_both_ways():
    # A client from before gens: its Transfer and the Allocated it reads decode as before.
    old = msgspec.msgpack.encode(["transfer", 9, 5, 0, b"", b"", -1, 0, 0, 0])
    assert m.decode_request(old).gens == b""
    old_allocated = msgspec.msgpack.encode(["allocated", 4, pack_u32([1]), [], 1])
    assert m.decode_reply(old_allocated).gens == b""

    # Peers from before read the new messages, without the field they do not know.
    store = m.Transfer(9, 5, m.Direction.STORE, pack_u32([1]), pack_u32([2]),
                       gens=pack_u32([7]))
    allocated = m.Allocated(4, pack_u32([2]), [], 1, pack_u32([7]))
    for msg, last in ((store, "lease"), (allocated, "allocated")):
        fields = [(f.name, f.type, f.default) for f in msgspec.structs.fields(type(msg))]
        upto = [f[0] for f in fields].index(last) + 1
        old_type = msgspec.defstruct("Old", fields[:upto], array_like=True,
                                     tag=msg.__struct_config__.tag)
        assert msgspec.msgpack.decode(m.encode(msg), type=old_type).req == msg.req
    assert m.decode_request(m.encode(store)) == store
    assert m.decode_reply(m.encode(allocated)) == allocated
