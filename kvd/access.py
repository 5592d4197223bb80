"""Who may talk to the daemon, and who may administer it.

ZeroMQ reports the peer of every ipc connection as ``Peer-Address`` =
``localhost:uid:gid:pid`` (the kernel's SO_PEERCRED, not something a client can claim).
A connection is accepted when its uid is the daemon's, root, or listed in
``allowed_uids``, or when the process belongs to one of ``allowed_groups`` (primary or
supplementary group, read from /proc). Admin requests (evict, flush, config) need a uid
in ``admin_uids`` (the daemon's own uid and root always are).
"""

from __future__ import annotations

import grp
import os
from dataclasses import dataclass

import zmq

from kvd.config import Config
from kvd.errors import ConfigError

# The config keys the rules below are made of.
ACCESS_KEYS = ("allowed_uids", "allowed_groups", "admin_uids")


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int
    address: str = ""  # ``Peer-Address`` as ZeroMQ gave it: the connection's credentials

    @classmethod
    def of(cls, frame: zmq.Frame) -> Peer:
        """Credentials of a frame's sender; -1 when the transport does not say."""
        try:
            address = peer_address(frame)
            _, uid, gid, pid = address.rsplit(":", 3)
            return cls(int(pid), int(uid), int(gid), address)
        except (zmq.ZMQError, ValueError, AttributeError):
            return UNKNOWN_PEER


UNKNOWN_PEER = Peer(0, -1, -1)  # the transport did not say


def peer_address(frame: zmq.Frame) -> str:
    """The sender's credentials, unparsed (a cheap per-message comparison)."""
    return frame.get("Peer-Address")


def _gid(name: str | int) -> int:
    if isinstance(name, int) or (str(name).isascii() and str(name).isdecimal()):
        return int(name)
    try:
        return grp.getgrnam(str(name)).gr_gid
    except KeyError:
        raise ConfigError(f"allowed_groups: no group named {name!r}") from None


def process_groups(pid: int) -> set[int]:
    """Supplementary groups of a process (empty when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return {int(g) for g in line.split()[1:]}
    except OSError:
        pass
    return set()


class Access:
    def __init__(self, config: Config) -> None:
        me = os.getuid()
        self.uids = {me, 0, *config.allowed_uids}
        self.gids = {_gid(g) for g in config.allowed_groups}
        self.admins = {me, 0, *config.admin_uids}

    def allowed(self, peer: Peer) -> bool:
        if peer.uid < 0:
            return False
        if peer.uid in self.uids or peer.gid in self.gids:
            return True
        return bool(self.gids and self.gids & process_groups(peer.pid))

    def admin(self, peer: Peer) -> bool:
        return peer.uid in self.admins
