"""The daemon's configuration: one frozen object, built from defaults < TOML file < KVD_*
environment variables < command-line flags, validated by msgspec.

An unknown key or a bad value is rejected with a message naming the key and where it
came from; sizes accept suffixes (``512M``, ``4G``, ``1T``).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import stat
import string
import tomllib
from collections.abc import Mapping
from fractions import Fraction
from typing import Any, Literal

import msgspec

from kvd.core.policies import policy_names
from kvd.errors import ConfigError
from kvd.tiers.disk_files import DATA_FILE, JOURNAL_FILE

log = logging.getLogger("kvd.config")

LogLevel = Literal["debug", "info", "warning", "error"]


def default_socket() -> str:
    """$XDG_RUNTIME_DIR/kvd/kvd.sock, else /tmp/kvd-$UID/kvd.sock."""
    run = os.environ.get("XDG_RUNTIME_DIR")
    base = os.path.join(run, "kvd") if run else f"/tmp/kvd-{os.getuid()}"
    return os.path.join(base, "kvd.sock")


def default_pool_path() -> str:
    return f"/dev/shm/kvd-{os.getuid()}.pool"


class Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    socket: str = msgspec.field(default_factory=default_socket)
    socket_mode: int = 0o660  # owner and group may connect
    pool_size: int = 512 * 1024**2
    pool_path: str = msgspec.field(default_factory=default_pool_path)
    extent_size: int = 64 * 1024**2
    min_slot_bytes: int = 4096
    prefault: bool = True
    mlock: bool = False
    policy: str = ""  # empty: the registry's default
    copy_threads: int = 2
    copy_nice: int = 10  # niceness of the copy threads: engines on the same cores win
    cuda: bool = True  # use the GPU data path when a CUDA device is usable
    persist: bool = False  # keep the pool file and an index journal across restarts
    journal_path: str = ""  # empty: <pool_path>.journal
    verify_on_load: bool = False  # check a block's xxh3 before every load
    max_lease_ms: int = 120_000
    max_pending_ms: int = 600_000
    store_claim_ms: int = 10_000  # a ticketed store no rank (or only some) made by then: given up
    max_keys_per_request: int = 65_536
    log_level: LogLevel = "info"
    metrics_port: int = 9727  # Prometheus endpoint; 0 disables it
    metrics_addr: str = "127.0.0.1"  # loopback: expose it wider on purpose only
    stop_timeout_ms: int = 10_000  # SIGTERM waits this long for in-flight transfers
    socket_group: str = ""  # group owning the socket (with socket_mode 0660: who connects)
    allowed_uids: list[int] = []  # besides the daemon's own uid and root
    allowed_groups: list[str] = []  # group names or gids whose members may connect
    admin_uids: list[int] = []  # may evict/flush/read config (own uid and root always)
    max_leased_blocks: int = 1 << 20  # per client: blocks held by its leases at once
    max_pending_blocks: int = 1 << 20  # per client: blocks allocated and not yet stored
    max_tenants: int = 1024  # fingerprints known at once; client-less ones make room
    client_timeout_ms: int = 10_000  # a client silent this long (no ping) is dropped
    max_message_bytes: int = 16 * 1024**2
    # KV events in vLLM's format for fleet routers (README "Fleet routing"); "" is off.
    events_endpoint: str = ""  # PUB address kvd binds, e.g. tcp://*:5557
    events_replay_endpoint: str = ""  # ROUTER for replay of missed batches, tcp://*:5558
    events_topic: str = "kv@{node}@{model}"  # also {tenant}: the tenant id
    events_node: str = ""  # the node's name in topics; "" is the host name
    events_int_hashes: bool = True  # hashes as 64-bit ints, like vLLM's default
    events_hwm: int = 100_000  # batches queued per subscriber before it misses some
    # Tiers below the pool (README "Tiers"); each is off while its key is empty.
    disk_path: str = ""  # directory of the disk tier: evicted blocks go there
    disk_size: int = 0  # bytes of the disk tier's slot file (required with disk_path)
    disk_policy: str = ""  # the disk tier's eviction policy; empty: the registry's default
    remote: str = ""  # redis://HOST:PORT[,HOST:PORT...]: a Redis/Valkey (cluster) shared by nodes
    remote_ttl_s: int = 86_400  # a block's TTL in the cluster; 0: the cluster's eviction only
    remote_timeout_ms: int = 500  # per cluster round trip
    remote_lookup_ms: int = 20  # a Lookup waits at most this long for the cluster (0: never)
    tier_queue_bytes: int = 256 * 1024**2  # per tier: bytes queued to go down; beyond, dropped
    promote_max_blocks: int = 512  # blocks one Lookup may bring up from the tiers

    def __post_init__(self) -> None:
        for key in sorted(SIZE_KEYS):
            if getattr(self, key) > MAX_SIZE:
                raise ValueError(f"{key} {getattr(self, key)} is more than 1 EiB")
        if not self.min_slot_bytes <= self.extent_size:
            raise ValueError(f"extent_size ({self.extent_size}) must hold a slot of "
                             f"min_slot_bytes ({self.min_slot_bytes})")
        for key in ("policy", "disk_policy"):
            if getattr(self, key) and getattr(self, key) not in policy_names():
                raise ValueError(f"{key} {getattr(self, key)!r}: known policies are "
                                 f"{', '.join(policy_names())}")
        if not 0 <= self.socket_mode <= 0o777:
            raise ValueError(f"socket_mode {self.socket_mode:#o} not in 0..0o777")
        if not MIN_MESSAGE_BYTES <= self.max_message_bytes <= MAX_MESSAGE_BYTES:
            raise ValueError(f"max_message_bytes {self.max_message_bytes} not in "
                             f"{MIN_MESSAGE_BYTES}..{MAX_MESSAGE_BYTES}")
        if self.pool_size < self.extent_size:
            raise ValueError(
                f"pool_size ({self.pool_size}) is smaller than extent_size ({self.extent_size})"
            )
        if not 1 <= self.copy_threads <= 256:
            raise ValueError(f"copy_threads {self.copy_threads} not in 1..256")
        if not 0 <= self.copy_nice <= 19:
            raise ValueError(f"copy_nice {self.copy_nice} not in 0..19")
        if self.min_slot_bytes < 64:
            raise ValueError("min_slot_bytes must be at least 64")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port {self.metrics_port} not in 0..65535")
        if self.events_replay_endpoint and not self.events_endpoint:
            raise ValueError("events_replay_endpoint needs events_endpoint")
        if self.socket.startswith("@") or not self.socket.strip():
            raise ValueError(f"socket {self.socket!r}: expected a file path (an abstract "
                             "socket has no file to guard with permissions)")
        if len(os.fsencode(self.socket)) > MAX_SOCKET_PATH:
            raise ValueError(f"socket {self.socket!r}: longer than a unix socket's path "
                             f"can be ({MAX_SOCKET_PATH} bytes)")
        for key in ("events_endpoint", "events_replay_endpoint"):
            if why := _endpoint_problem(getattr(self, key)):
                raise ValueError(f"{key} {getattr(self, key)!r}: {why}")
        if why := _topic_problem(self.events_topic):
            raise ValueError(f"events_topic {self.events_topic!r}: use only {{node}}, "
                             f"{{model}} and {{tenant}}, without formats ({why})")
        if not 1 <= self.max_tenants <= 1 << 20:
            raise ValueError(f"max_tenants {self.max_tenants} not in 1..{1 << 20}")
        if not 1 <= self.events_hwm <= INT_MAX:  # ZeroMQ takes it as a C int
            raise ValueError(f"events_hwm {self.events_hwm} not in 1..{INT_MAX}")
        if not _host_name(self.metrics_addr):
            raise ValueError(f"metrics_addr {self.metrics_addr!r}: expected an IP address "
                             "or a host name")
        if self.disk_path and self.disk_size < self.extent_size:
            raise ValueError(f"disk_size ({self.disk_size}) must hold at least one extent "
                             f"({self.extent_size} bytes) when disk_path is set")
        if self.remote and not all(u.strip() for u in self.remote.split(",")):
            raise ValueError(f"remote {self.remote!r}: expected redis://HOST:PORT[,HOST:PORT...]")
        if self.remote_lookup_ms < 0:
            raise ValueError("remote_lookup_ms must be 0 (never wait) or more")
        for key in ("remote_timeout_ms", "tier_queue_bytes", "promote_max_blocks",
                    "max_lease_ms", "max_pending_ms", "store_claim_ms", "client_timeout_ms",
                    "max_keys_per_request", "max_leased_blocks", "max_pending_blocks"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be at least 1")
        for key in ("allowed_uids", "admin_uids"):
            bad = [u for u in getattr(self, key) if not 0 <= u < 0xFFFFFFFF]
            if bad:  # -1 and 2**32-1 mean "no uid" to the kernel: no peer ever matches
                raise ValueError(f"{key}: {bad[0]} is not a uid (0..{0xFFFFFFFF - 1})")
        if self.stop_timeout_ms < 0:
            raise ValueError("stop_timeout_ms must be 0 (no wait) or more")
        if not 0 <= self.remote_ttl_s <= MAX_TTL_S:  # (Redis refuses an EX past 2**63 ms)
            raise ValueError(f"remote_ttl_s {self.remote_ttl_s} not in 0 (no TTL).."
                             f"{MAX_TTL_S} (100 years)")
        for key in [k for k in self.__struct_fields__ if k.endswith("_ms")]:
            if getattr(self, key) > MAX_MS:
                raise ValueError(f"{key} {getattr(self, key)} is more than 30 days (a time "
                                 "this long overflows the clocks it is added to)")
        files = {"pool_path": self.pool_path, "journal_path": self.journal,
                 "socket": self.socket}
        for key in ("events_endpoint", "events_replay_endpoint"):
            if (endpoint := getattr(self, key)).startswith("ipc://"):
                files[key] = path = endpoint[len("ipc://"):]
                if os.path.lexists(path) and not stat.S_ISSOCK(os.lstat(path).st_mode):
                    raise ValueError(f"{key} {endpoint!r}: {path} is a file that is not a "
                                     "socket (binding there would replace it)")
        if self.disk_path:  # (the disk tier's own two files)
            files |= {f"disk_path's {name}": os.path.join(self.disk_path, name)
                      for name in (DATA_FILE, JOURNAL_FILE)}
        seen: dict[str, str] = {}
        for key, path in files.items():
            other = seen.setdefault(os.path.realpath(path), key)
            if other != key:  # one file would be two things: each overwrites the other
                raise ValueError(f"{key} and {other} are the same file ({path})")

    @property
    def pool_bytes(self) -> int:
        """What the pool file holds: whole extents (a rest of pool_size would be
        reserved, and pinned in RAM, without ever holding a block)."""
        return self.pool_size // self.extent_size * self.extent_size

    @property
    def journal(self) -> str:
        return self.journal_path or self.pool_path + ".journal"

    @property
    def checksums(self) -> bool:
        """Checksums cost a hash per stored block: computed only when something reads them."""
        return self.persist or self.verify_on_load


MAX_SIZE = 1 << 60  # bytes: sizes beyond this are typos (the kernel refuses them anyway)
MIN_MESSAGE_BYTES = 4096  # below this, a Register of an ordinary engine cannot get through
MAX_MESSAGE_BYTES = 1 << 30  # the daemon's socket takes twice this (MAXMSGSIZE, an int64)
INT_MAX = (1 << 31) - 1
MAX_MS = 30 * 86_400_000  # any time key: longer ones are typos (and overflow clocks)
MAX_SOCKET_PATH = 107  # bytes of sun_path, less its NUL
MAX_TTL_S = 100 * 365 * 86_400


def _endpoint_problem(value: str) -> str:
    """Why ``value`` is no endpoint ZeroMQ binds as meant ('' when it is, or is empty):
    a port past 65535 wrapped around to another port."""
    if not value:
        return ""
    scheme, _, rest = value.partition("://")
    if scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        if not colon or not host:
            return "expected tcp://HOST:PORT"
        if port != "*" and not (port.isascii() and port.isdigit() and int(port) <= 65535):
            return f"port {port!r} is not 0..65535 or *"
        return ""
    if scheme in ("ipc", "inproc"):
        return "" if rest else f"expected {scheme}://NAME"
    return "expected tcp://HOST:PORT or ipc://PATH"


def _topic_problem(topic: str) -> str:
    """Why ``topic`` is no topic template ('' when it is): a field of another name, an
    attribute or index of one, or a format (``{tenant:>999999999}`` took a GiB per use)."""
    try:
        for _, field, spec, conversion in string.Formatter().parse(topic):
            if field is None:
                continue
            if field not in ("node", "model", "tenant"):
                return f"{{{field}}}"
            if spec or conversion:
                return f"{{{field}{'!' + conversion if conversion else ''}" \
                       f"{':' + spec if spec else ''}}}"
    except ValueError as e:  # an unmatched brace
        return str(e)
    return ""


_HOST_RE = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?\.?$")


def _host_name(value: str) -> bool:
    """An IP literal or a name that could resolve (no spaces, ports or schemes); empty
    binds every interface (IPv4)."""
    if not value:
        return True
    try:
        ipaddress.ip_address(value)
        return True
    except ValueError:
        return len(value) <= 253 and _HOST_RE.match(value) is not None


FIELDS = frozenset(Config.__struct_fields__)
LIST_KEYS = frozenset({"allowed_uids", "allowed_groups", "admin_uids"})
SIZE_KEYS = frozenset({"pool_size", "extent_size", "min_slot_bytes", "disk_size",
                       "tier_queue_bytes"})
_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(value: str | int) -> int:
    """'512M' -> 536870912; ints pass through."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = _SIZE_RE.match(str(value))
    if not m:
        raise ValueError(f"not a size: {value!r} (use e.g. 512M, 4G)")
    size = Fraction(m.group(1)) * _UNITS[m.group(2).upper()]  # exact: no float rounding
    if size.denominator != 1:
        raise ValueError(f"not a whole number of bytes: {value!r}")
    return int(size)


def _normalize(raw: Mapping[str, Any], source: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in raw.items():
        k = key.replace("-", "_")
        if k not in FIELDS:
            raise ConfigError(f"{source}: unknown key {key!r}")
        if k in out:  # max-lease-ms and max_lease_ms both: which one was meant?
            raise ConfigError(f"{source}: {k} is given twice (as - and _ spellings)")
        if k in SIZE_KEYS:
            try:
                value = parse_size(value)
            except ValueError as e:
                raise ConfigError(f"{source}: {key}: {e}") from None
        elif k in LIST_KEYS and isinstance(value, str):  # KVD_ALLOWED_UIDS=1000,1001
            value = [v.strip() for v in value.split(",") if v.strip()]
        elif k == "socket_mode" and isinstance(value, str):  # KVD_SOCKET_MODE=0660: octal
            try:
                value = int(value.strip().removeprefix("0o").removeprefix("0O") or "x", 8)
            except ValueError:
                raise ConfigError(f"{source}: socket_mode: not an octal mode: {value!r} "
                                  "(use e.g. 0660)") from None
        if k == "allowed_groups" and isinstance(value, list):  # names or gids
            value = [str(v) if isinstance(v, int) and not isinstance(v, bool) else v
                     for v in value]
        out[k] = value
    return out


def env_values(environ: Mapping[str, str]) -> dict[str, Any]:
    """KVD_POOL_SIZE=4G -> {'pool_size': '4G'}; KVD_* names that are not keys are errors."""
    raw = {
        k[4:].lower(): v
        for k, v in environ.items()
        if k.startswith("KVD_") and k != "KVD_CONFIG" and not _SERVICE_LINK.match(k)
    }
    return raw


# What Kubernetes puts into every pod of a namespace with a Service named ``kvd`` (its
# service links): not configuration, and refusing them would stop every pod's restart.
_SERVICE_LINK = re.compile(r"^KVD_(SERVICE_(HOST|PORT)(_\w+)?|PORT(_\d+_(TCP|UDP|SCTP)\w*)?)$")


MAX_CONFIG_BYTES = 1 << 20


def read_toml(file: str) -> dict[str, Any]:
    """A TOML file's table; ConfigError for every way it can fail to be one. Only a
    regular file of at most ``MAX_CONFIG_BYTES``: a reload reads it on the daemon's
    event loop, and a FIFO (or /dev/zero) would hold every client there."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK)  # (a FIFO's open would wait)
        with open(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ConfigError(f"config file {file} is not a regular file")
            data = f.read(MAX_CONFIG_BYTES + 1)
        if len(data) > MAX_CONFIG_BYTES:
            raise ConfigError(f"config file {file} is over {MAX_CONFIG_BYTES >> 20} MiB")
        return tomllib.loads(data.decode("utf-8"))
    except OSError as e:
        raise ConfigError(f"cannot read config file {file}: {e.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{file}: not valid TOML: {e}") from None
    except RecursionError:
        raise ConfigError(f"{file}: not valid TOML: nested too deeply") from None


def load(
    file: str | None = None,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> tuple[Config, dict[str, str]]:
    """The effective config and, per key, where its value came from."""
    environ = os.environ if environ is None else environ
    file = file or environ.get("KVD_CONFIG")
    layers: list[tuple[str, dict[str, Any]]] = []
    if file:
        layers.append((f"file {file}", _normalize(read_toml(file), f"config file {file}")))
    layers.append(("env", _normalize(env_values(environ), "environment (KVD_*)")))
    layers.append(("flag", _normalize({k: v for k, v in (flags or {}).items() if v is not None},
                                      "command line")))
    merged: dict[str, Any] = {}
    origin = {k: "default" for k in FIELDS}
    for source, values in layers:
        merged.update(values)
        origin.update({k: source for k in values})
    try:
        cfg = msgspec.convert(merged, Config, strict=False)
    except msgspec.ValidationError as e:
        # msgspec names the key as `$.key`, the checks above by its name first: say
        # where the value came from as well.
        m = re.search(r"\$\.(\w+)", str(e))
        named = [m.group(1)] if m else [w for w in re.findall(r"\w+", str(e)) if w in origin]
        set_by = [origin[k] for k in named if origin[k] != "default"] or \
            [origin[k] for k in named]
        where = f" (from {set_by[0]})" if set_by else ""
        raise ConfigError(f"invalid configuration: {e}{where}") from None
    for problem in _hidden_problems(layers, merged):
        log.warning("%s", problem)
    return cfg, origin


def _hidden_problems(layers: list[tuple[str, dict[str, Any]]],
                     merged: dict[str, Any]) -> list[str]:
    """Values a higher source hides that would be refused without it: they pass unseen
    today and stop the daemon the day that source goes (an Environment= line or a flag
    dropped from the unit). Said only where the hidden values are the cause: the
    configuration without the hiding source is refused, and accepted without them too."""
    def refused(config: dict[str, Any]) -> str:
        try:
            msgspec.convert(config, Config, strict=False)
        except (msgspec.ValidationError, ValueError) as e:
            return str(e)
        return ""

    def hidden_by(values: dict[str, Any], hiders: list[int]) -> list[str]:
        return sorted(k for k in values if any(
            k in layers[j][1] and layers[j][1][k] != values[k] for j in hiders))

    problems = []
    for i, (source, values) in enumerate(layers):
        above = [j for j in range(i + 1, len(layers)) if hidden_by(values, [j])]
        said: set[str] = set()
        # Each hiding source left out alone; then all of them at once (a value hidden
        # by a variable and a flag both is still hidden with either one gone).
        for hiders in [[j] for j in above] + ([above] if len(above) > 1 else []):
            hidden = hidden_by(values, hiders)
            if said.issuperset(hidden):  # (the sources at once: only what is new)
                continue
            without = {k: v for n, (_, layer) in enumerate(layers) if n not in hiders
                       for k, v in layer.items()}
            why = refused(without)
            if why and not refused({k: v for k, v in without.items() if k not in hidden}
                                   | {k: v for n, (_, layer) in enumerate(layers)
                                      if n < i for k, v in layer.items() if k in hidden}):
                what = ", ".join(f"{k} = {values[k]!r}" for k in hidden)
                names = " and the ".join(f"{layers[j][0]}'s" for j in hiders)
                problems.append(f"{source}: {what} would be refused without the {names} "
                                f"value{'s' * (len(hiders) > 1)} ({why}); hidden for now")
                said.update(hidden)
    return problems
