"""kvd's vLLM integration: ``KvdConnector`` and the ``KvdOffloadingSpec`` behind it.

Only this subpackage imports vLLM (``import kvd_client`` does not). Supported: vLLM
0.32 and 0.33 (their offloading APIs; 0.33's ``expedited`` loads and manager ``lock``
default are handled).
"""

from __future__ import annotations

SUPPORTED = ((0, 32), (0, 33))


class UnsupportedVllmVersion(ImportError):
    pass


def check_vllm_version(version: str | None = None) -> None:
    """Raise UnsupportedVllmVersion unless vLLM is a release kvd was written for."""
    if version is None:
        import vllm  # noqa: PLC0415

        version = vllm.__version__
    parts = version.split(".")
    try:
        major_minor = (int(parts[0]), int(parts[1]))
    except (ValueError, IndexError):
        major_minor = (-1, -1)
    if major_minor not in SUPPORTED:
        raise UnsupportedVllmVersion(
            f"kvd_client.vllm supports vLLM 0.32 and 0.33, found vLLM {version}; install "
            "a supported vLLM or a kvd release written for yours")


check_vllm_version()

from kvd_client.vllm.connector import KvdConnector  # noqa: E402
from kvd_client.vllm.spec import KvdOffloadingSpec, KvdOptions, KvdSlots  # noqa: E402

__all__ = ["KvdConnector", "KvdOffloadingSpec", "KvdOptions", "KvdSlots",
           "UnsupportedVllmVersion", "check_vllm_version"]
