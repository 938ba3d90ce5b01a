"""``tandem loadtest``: the running system under load, measured from outside.

Where the core benchmark (``bench/``) times the allocator's decision function in-process, this
harness runs what users run — ``nats-server``, the inventory and the allocator replicas as
separate processes started the way the chart starts them, and a simulated fleet that really
publishes inventory and heartbeats and applies and cleans up its allocations over NATS — and
measures it from outside: decisions per second, submit → assigned and submit → applied
latencies, readiness time, peak memory per process, and the JetStream ceiling of the same
server beside them. It also checks the safety invariants on the system's own records (no
device held twice, no GPU shared past what it has, no request placed twice, none lost):
on a few snapshots, and at every write of every node and request record (the ledger).

Modules::

    config      what a run is asked to do (the flags), checked
    harness     one run: server, ceiling, services, fleet, probe, load, drain, teardown
    production  the production profile: 3 servers, TLS, the auth callout, one token per component and node
    tokenreview the API server's TokenReview for those tokens (the one Kubernetes boundary faked)
    scrape      a real Prometheus scraping every component during the run
    faults      a NATS server SIGKILLed mid-run and brought back (--kill-server-at)
    procs       child processes: config file + environment, readiness, SIGTERM → SIGKILL, RSS
    meter       CPU and peak RSS of every process by role, CPU per decision
    events      the fleet's JSON lines on its stdout
    fleet       ``python -m tools.loadtest.fleet``: one process speaking for N nodes
    driver      submits, releases, paces, observes outcomes on core subscriptions
    invariants  KV snapshots of ``tandem-allocs``: double-held devices, overcommitted GPUs, double placements
    checker     ``python -m tools.loadtest.checker``: the checks during the load, at a pace
    ledger      every revision judged: held twice, vanished, freed unknown (pure)
    ledgerwatch ``python -m tools.loadtest.ledgerwatch``: the ledger fed from the KV streams
    ceiling     async-publish and pull+ack rates of a scratch stream
    mix         fleet composition and the seeded request stream (pure)
    publisher   many JetStream publishes in flight, retried with their msg id
    report      the JSON line and the human summary (pure)

Errors: :class:`LoadtestError` (one line, names the stage and the log to read).

The package imports none of its modules: ``bench/`` reads ``mix`` alone, without the harness
and the Kubernetes client the production profile's TokenReview brings (a heavy import, in
every benchmark child). Import from the modules themselves.
"""
