"""kvd's wire protocol, shared by the daemon and its clients."""

from kvd_proto.ids import NO_SLOT, pack_u32, unpack_u32
from kvd_proto.messages import PROTOCOL_VERSION, Code, Direction

__all__ = ["NO_SLOT", "PROTOCOL_VERSION", "Code", "Direction", "pack_u32", "unpack_u32"]
