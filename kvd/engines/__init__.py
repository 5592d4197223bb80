"""Transfer engines: threads that move bytes and report back to the event loop."""
