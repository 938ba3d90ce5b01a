"""Pure allocation core (no I/O imports; enforced by import-linter, see ``.importlinter``)."""
