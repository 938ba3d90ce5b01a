"""State in JetStream KV: the records services share, and reading them.

* :mod:`.records` — :class:`~.records.RecordStore`, the compare-and-set store of one bucket's
  records (node allocations, requests, jobs ...) shared by the allocator and the inventory;
* :mod:`.watch` — following a bucket: each change handed over as it is stored;
* :mod:`.read` — one complete read of a whole bucket (the CLI, resyncs), reading on past the
  server's early "nothing pending".

Apart from :mod:`services.runtime.nats` because it is a different job on top of it: the NATS
kit moves messages and knows no record; these modules know what a record and its revision are
(DESIGN.md: a node's allocation record is the unit of atomicity). :mod:`.read` needs only
nats-py, so the CLI reads records without loading the service kit.
"""
