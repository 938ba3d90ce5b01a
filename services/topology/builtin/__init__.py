"""Built-in node topologies (YAML package data); list them with ``tandem topology list``."""
