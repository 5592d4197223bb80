"""The daemon's one error root, subclassed by what the caller should do next.

    KvdError
    ├── RequestError        the request is wrong: answer it with a typed error
    │   ├── NotRegistered
    │   └── BadIds
    ├── TransferError       a copy failed (permission, client gone, bad address)
    ├── TierError           a tier below the pool is unusable now (I/O, cluster down)
    └── ConfigError         the configuration is invalid: refuse to start
"""

from __future__ import annotations

from kvd_proto.messages import Code


class KvdError(Exception):
    code: Code = Code.INTERNAL

    def __init__(self, message: str, code: Code | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class RequestError(KvdError):
    code = Code.BAD_REQUEST


class NotRegistered(RequestError):
    code = Code.NOT_REGISTERED


class BadIds(RequestError):
    code = Code.BAD_IDS


class TransferError(KvdError):
    code = Code.TRANSFER_FAILED


class TierError(KvdError):
    """A tier below the RAM pool cannot be used right now (I/O error, cluster down,
    timeout): the daemon counts it and goes on serving from RAM."""


class BreakerOpen(TierError):
    """A call not made: the tier's breaker is open (or its one trial call is out); the
    failures that opened it were counted already."""

    code = Code.BUSY


class ConfigError(KvdError):
    code = Code.BAD_REQUEST
