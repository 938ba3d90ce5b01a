"""The inventory service: the authority for what exists and whether it is healthy."""
