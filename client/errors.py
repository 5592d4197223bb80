"""The client's one error root, subclassed by what the caller does next.

    KvdClientError
    ├── Unavailable       the daemon is down, restarting or too slow: treat as a miss
    │   └── Timeout       one call passed its deadline
    └── RemoteError       the daemon answered with a typed error (``code``)
"""

from __future__ import annotations

from kvd_proto.messages import Code


class KvdClientError(Exception):
    pass


class Unavailable(KvdClientError):
    pass


class Timeout(Unavailable):
    pass


class RemoteError(KvdClientError):
    def __init__(self, code: Code, message: str) -> None:
        super().__init__(f"{Code(code).name}: {message}")
        self.code = Code(code)
        self.message = message

    def __reduce__(self):  # picklable across processes despite the two-argument init
        return (type(self), (self.code, self.message))
