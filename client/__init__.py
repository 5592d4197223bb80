"""The thin kvd client: a fail-open connection and memory registration helpers."""

from kvd_client.connection import ClientStats, Connection
from kvd_client.errors import KvdClientError, RemoteError, Timeout, Unavailable
from kvd_client.memory import host_region, host_regions

__all__ = [
    "ClientStats",
    "Connection",
    "KvdClientError",
    "RemoteError",
    "Timeout",
    "Unavailable",
    "host_region",
    "host_regions",
]
