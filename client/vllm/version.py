"""The vLLM releases kvd's integration was written for (checked before vLLM is used)."""

from __future__ import annotations

SUPPORTED = ((0, 32), (0, 33))


class UnsupportedVllmVersion(ImportError):
    pass


def vllm_minor(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of ``version``, else of the installed vLLM; (-1, -1) if unreadable."""
    if version is None:
        import vllm  # noqa: PLC0415

        version = vllm.__version__
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (ValueError, IndexError):
        return -1, -1


def check_vllm_version(version: str | None = None) -> None:
    """Raise UnsupportedVllmVersion unless vLLM is a release kvd was written for."""
    if version is None:
        import vllm  # noqa: PLC0415

        version = vllm.__version__
    major_minor = vllm_minor(version)
    if major_minor not in SUPPORTED:
        raise UnsupportedVllmVersion(
            f"kvd_client.vllm supports vLLM 0.32 and 0.33, found vLLM {version}; install "
            "a supported vLLM or a kvd release written for yours")
