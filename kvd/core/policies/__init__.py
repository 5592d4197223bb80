"""Eviction policies behind one interface, found by name."""

from kvd.core.policies.base import (
    DEFAULT_POLICY,
    EvictionPolicy,
    make_policy,
    policy_names,
)

__all__ = ["DEFAULT_POLICY", "EvictionPolicy", "make_policy", "policy_names"]
