"""Reproducible benchmarks for the allocator core (``make bench`` runs ``python -m bench.run``).

``exhaustive`` is the plain reference search the property tests and the optimality benchmark
compare against; ``randtopo`` builds random small topologies; ``baselines`` re-implements the
published behaviour of other allocators for the quality comparison.
"""
