"""kvd's vLLM integration: ``KvdConnector`` and the ``KvdOffloadingSpec`` behind it.

Only this subpackage imports vLLM (``import kvd_client`` does not). Supported: vLLM
0.32 and 0.33 (their offloading APIs; 0.33's ``expedited`` loads and manager ``lock``
default are handled).
"""

from __future__ import annotations

from kvd_client.vllm.version import (
    SUPPORTED,
    UnsupportedVllmVersion,
    check_vllm_version,
)

check_vllm_version()

from kvd_client.vllm.connector import KvdConnector  # noqa: E402
from kvd_client.vllm.options import KvdOptions, KvdSlots  # noqa: E402
from kvd_client.vllm.spec import KvdOffloadingSpec  # noqa: E402

__all__ = ["SUPPORTED", "KvdConnector", "KvdOffloadingSpec", "KvdOptions", "KvdSlots",
           "UnsupportedVllmVersion", "check_vllm_version"]
