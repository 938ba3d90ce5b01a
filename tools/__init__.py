"""Tandem's tools: what people run beside the deployed services, never deployed as one.

``tools.cli`` is the ``tandem`` command, ``tools.loadtest`` the load harness, ``tools.chaos``
the fault-injection suite and ``tools.localstack`` the whole system in one process (``tandem
up``, the demo, the end-to-end tests). Tools sit on top of the layers (docs/architecture.md,
"Layers"): they may import every service and the kit below them, and nothing under
``schemas`` or ``services`` imports a tool (import-linter's ``layers`` contract).
"""
