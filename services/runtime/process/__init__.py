"""Running a service as a process: its main, its tasks, and the servers it may start.

* :mod:`.lifecycle` — ``python -m services.<service>``: settings, logging and tracing set up
  once, connect and build, run until SIGTERM, shut down within the grace period;
* :mod:`.tasks` — supervised tasks (no bare ``create_task``): a crashed task restarted or
  reported, never lost;
* :mod:`.embedded` — the ``nats-server`` binary started for ``tandem up``, tests and tools;
* :mod:`.jaeger` — a local Jaeger all-in-one for ``tandem up --jaeger`` and the cluster tests.

The settings (:mod:`services.runtime.settings`) and the kit's errors
(:mod:`services.runtime.errors`) stay at the kit's root, not here: every part of the kit reads
them, and the NATS kit (which needs the settings) is itself used by :mod:`.lifecycle`; inside
this package they would make ``process`` and ``nats`` import each other, a circle the
``acyclic_siblings`` import contract refuses.
"""
