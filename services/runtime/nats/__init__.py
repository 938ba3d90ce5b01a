"""The NATS kit: everything a service does on NATS, behind one :class:`~.bus.Bus`.

Services import :mod:`services.runtime.nats.bus` (the ``Bus`` and the names that go with it:
``Delivery``, ``Retry``, ``Refuse``, ``ConnectError``, ``provision`` ...); the modules behind
it each do one job:

* :mod:`.connection` — connect (reconnecting, giving up only on a refusal no retry mends) and
  close within a bound; :mod:`.auth` — credentials, TLS, the server list (the CLI's own
  connection uses it without the rest of the kit);
* :mod:`.provision` — every stream and KV bucket, created or brought up to date;
* :mod:`.publish` — JetStream publishes that ride out a stream leader election;
  :mod:`.puback` — their acknowledgements through one inbox, and the message ids;
* :mod:`.consume` — durable pull consumers (:mod:`.puller`: the pull protocol) and core
  subscriptions; :mod:`.jsack` — a delivery's position read from its reply subject;
* :mod:`.deadletters` — the checks a message passes (size, decoding, routing), the dead
  letters of what fails them, and the per-source budget that bounds those;
* :mod:`.consumerlag` — how far each durable consumer is behind (a metric).

This package keeps the library's name on purpose: imports are absolute, so ``import nats``
anywhere (here too) is nats-py; this package is always ``services.runtime.nats``. The package
itself imports nothing, so importing :mod:`.auth` does not load the Bus, tracing or metrics.
"""
