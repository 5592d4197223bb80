"""Command-line entry points: ``kvd serve`` and ``kvdctl``."""
