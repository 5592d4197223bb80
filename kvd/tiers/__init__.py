"""Tiers below the RAM pool: a restart-safe local disk tier and a Redis/Valkey cluster
shared by the fleet, each a ``Tier`` found by name."""

from kvd.tiers.base import BlockHeader, Tier, TierBlock, TierError, make_tier

__all__ = ["BlockHeader", "Tier", "TierBlock", "TierError", "make_tier"]
