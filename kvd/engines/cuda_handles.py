"""What a CUDA client registered, opened in the daemon: IPC memory and event handles,
shared by the clients of one process, each opened once and closed exactly once; and the
checks made before anything is opened or copied (the GPU is visible, the client's
geometry stays inside the allocation it exported, one PID namespace).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from kvd.engines.cuda_device import Lane, Work
from kvd.errors import RequestError, TransferError
from kvd_client.cudart import CudaApi, CudaError
from kvd_proto.messages import Code, CudaRegion

log = logging.getLogger("kvd.engines.cuda")

Key = tuple[int, bytes]  # (client pid, handle bytes)
# cudaIpcOpen* failures the usual advice (namespaces, cudaMalloc) does not fit.
OPEN_ADVICE = {
    2: (("the daemon's GPU context has no room to map it (cudaErrorMemoryAllocation: "
         "device memory or BAR1 space); retried at the next registration"), Code.NO_SPACE),
    217: (("peer access between the daemon's context and that memory is not supported "
           "(cudaErrorPeerAccessUnsupported)"), Code.PERMISSION),
}
DEFAULT_OPEN_ADVICE = (("Legacy CUDA IPC needs the daemon and the engine in one PID "
                       "namespace on one node, and memory from cudaMalloc (not expandable "
                       "segments or cuMemCreate)"), Code.PERMISSION)


def format_uuid(raw: bytes) -> str:
    """``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``, as nvidia-smi -L prints it."""
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def refuse_foreign_pid_namespace(hello_pid: int, peer_pid: int) -> None:
    """Raise when the client lives in another PID namespace than the daemon.

    ``hello_pid`` is the pid the client reports for itself, ``peer_pid`` the one the
    kernel reports for the socket peer; they differ exactly when the namespaces differ,
    and then legacy CUDA IPC fails ("invalid device context").
    """
    if hello_pid != peer_pid:
        raise RequestError(
            f"the client (pid {hello_pid} in its namespace, {peer_pid} in the daemon's) runs "
            "in a separate PID namespace, where CUDA IPC handles cannot be opened. Fix: share "
            "the host PID namespace (Kubernetes hostPID: true, docker --pid=host), or "
            "register with client_copy=True so the client copies into the pool itself",
            Code.PERMISSION,
        )


def open_failure(pid: int, error: Exception) -> TransferError:
    """A client's handles that did not open, answered for the cause."""
    advice, code = OPEN_ADVICE.get(error.code if isinstance(error, CudaError) else 0,
                                   DEFAULT_OPEN_ADVICE)
    return TransferError(f"cannot open the CUDA IPC handles of pid {pid}: {error}. {advice}",
                         code)


def region_end(r: CudaRegion) -> int:
    """Bytes of its allocation the region reaches, from the allocation base."""
    return r.offset + (r.num_blocks - 1) * r.stride + r.page_bytes


@dataclass(eq=False)
class Client:
    """One attached worker: its opened handles, its store lane, its jobs in the engine."""

    pid: int
    device: Device
    mem_keys: list[tuple[int, bytes]]
    events: list[int]
    event_keys: list[tuple[int, bytes]]
    lane: Lane | None = None  # its store lane
    works: set[Work] = field(default_factory=set)  # submitted, not finished
    copying: int = 0  # works whose copies are on the GPU
    gone: bool = False
    released: bool = False


@dataclass(eq=False)
class Opened:
    """One opened IPC handle (memory or event), shared by clients of the same pid."""

    value: int  # device pointer or event
    device: Device
    refs: int = 1


@dataclass(eq=False)
class Device:
    """One GPU, found by UUID: its primary context and its load lane."""

    ordinal: int
    uuid: bytes
    ctx: int
    loads: Lane | None = None
    lost: str = ""  # why the context runs nothing any more (a sticky error), or ""


class Handles:
    """The opened handles of every client, by (pid, handle): ``open`` a client's,
    ``release`` them (idempotent: references are dropped once). Caller holds its lock."""

    def __init__(self, api: CudaApi) -> None:
        self.api = api
        self.mem: dict[Key, Opened] = {}
        self.events: dict[Key, Opened] = {}

    def open(self, c: Client, regions: list[CudaRegion], events: list[bytes]) -> None:
        """Open what ``c`` registered (its device's context current), then check it."""
        for h in dict.fromkeys(r.ipc_handle for r in regions):
            c.mem_keys.append(self._open(self.mem, (c.pid, h), c.device,
                                         self.api.ipc_open_mem_handle, h))
        for h in events:
            c.event_keys.append(self._open(self.events, (c.pid, h), c.device,
                                           self.api.ipc_open_event_handle, h))
            c.events.append(self.events[(c.pid, h)].value)
        self._check_geometry(c, regions)

    def base(self, c: Client, handle: bytes) -> int:
        return self.mem[(c.pid, handle)].value

    def _check_geometry(self, c: Client, regions: list[CudaRegion]) -> None:
        """Refuse regions that reach past their allocation: a copy there would raise a
        sticky illegal-address error for every client of the GPU, or write another
        client's memory."""
        for r in regions:
            base = self.base(c, r.ipc_handle)
            start, size = self.api.address_range(base)
            have = start + size - base
            if region_end(r) > have:
                raise RequestError(
                    f"a cuda region reaches {region_end(r)} bytes into its allocation, which "
                    f"has {have} (offset {r.offset} + {r.num_blocks - 1} blocks x stride "
                    f"{r.stride} + page {r.page_bytes})", Code.SIZE_MISMATCH)

    def _open(self, table: dict[Key, Opened], key: Key, dev: Device,
              opener: Callable[[bytes], int], handle: bytes) -> Key:
        got = table.get(key)
        if got is not None:
            got.refs += 1
        else:
            table[key] = Opened(opener(handle), dev)
        return key

    def release(self, c: Client) -> None:
        """Drop the client's references; close handles nobody else uses."""
        for table, keys, closer in ((self.mem, c.mem_keys, self.api.ipc_close_mem_handle),
                                    (self.events, c.event_keys, self.api.event_destroy)):
            for key in keys:
                got = table[key]
                got.refs -= 1
                if got.refs == 0:
                    del table[key]
                    try:
                        closer(got.value)
                    except Exception as e:  # noqa: BLE001 - nothing else to do: log
                        log.warning("closing a CUDA IPC handle of pid %d: %s", c.pid, e)
            keys.clear()
