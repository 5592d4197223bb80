"""Block states in the index and the "no slot" marker shared by index and wire."""

FREE, PENDING, READY = 0, 1, 2
NO_SLOT = 0xFFFFFFFF
