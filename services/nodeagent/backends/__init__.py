"""Discovery and apply backends of the node agent (see ``base`` for the protocols)."""
