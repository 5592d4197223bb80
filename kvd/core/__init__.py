"""The pure core: index, allocator, tenants and eviction policies.

Nothing here does I/O or imports the daemon shell; everything is single-threaded and
driven by the one event loop that owns daemon state.
"""
