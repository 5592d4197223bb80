"""kvd: a per-node KV-cache offload daemon for vLLM."""

__version__ = "0.1.0"
