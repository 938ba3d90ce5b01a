"""Tandem services: allocator, inventory, nodeagent, admission, plus the shared runtime kit."""
