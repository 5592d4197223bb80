"""The vLLM releases kvd's integration was written for (checked before vLLM is used)."""

from __future__ import annotations

SUPPORTED = ((0, 32), (0, 33))


class UnsupportedVllmVersion(ImportError):
    pass


def _installed() -> str:
    import vllm  # noqa: PLC0415

    return vllm.__version__


def vllm_minor(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of ``version``, else of the installed vLLM; (-1, -1) if unreadable."""
    parts = (_installed() if version is None else version).split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (ValueError, IndexError):
        return -1, -1


def check_vllm_version(version: str | None = None) -> None:
    """Raise UnsupportedVllmVersion unless vLLM is a release kvd was written for."""
    version = _installed() if version is None else version
    if vllm_minor(version) not in SUPPORTED:
        raise UnsupportedVllmVersion(
            f"kvd_client.vllm supports vLLM 0.32 and 0.33, found vLLM {version}; install "
            "a supported vLLM or a kvd release written for yours")
