# The two commands: `make demo` and `make test`. Both bootstrap .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test cluster-bins cluster-test bench-kube bench-dra jaeger lint typecheck unit integration bench bench-gang bench-e2e bench-claims bench-cli bench-preempt bench-shares bench-mig gpu-check clean image image-test prometheus prometheus-test soak

# The container image: one for every service (Dockerfile). The tag is the version in
# pyproject.toml, which is also the chart's appVersion and default image tag (tests/chart checks
# they agree). BUILDER: docker (when its daemon answers), else podman, else buildah.
VERSION := $(shell sed -n 's/^version = "\(.*\)"$$/\1/p' pyproject.toml)
IMAGE ?= ghcr.io/tandem-project/tandem
BASE ?= python:3.11-slim
BUILDER ?= $(shell if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then echo docker; \
	elif command -v podman >/dev/null 2>&1; then echo podman; elif command -v buildah >/dev/null 2>&1; then echo buildah; fi)
# Extra build options, e.g. "--network host -v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro".
IMAGE_BUILD_FLAGS ?=
REVISION ?= $(shell git rev-parse --short HEAD 2>/dev/null)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/tandem demo

lint: $(STAMP)
	$(BIN)/ruff check schemas services tools tests bench
	$(BIN)/lint-imports

typecheck: $(STAMP)
	$(BIN)/mypy

test: lint typecheck
	$(BIN)/pytest -q

bench: $(STAMP)
	$(BIN)/python -m bench.run

# Whole jobs across a 4-tier fabric at 2,000 nodes, against the per-pod and the
# gang-without-fabric baselines (docs/benchmarks.md, "Whole jobs"); core in one process.
BENCH_GANG_ARGS ?=
bench-gang: $(STAMP)
	$(BIN)/python -m bench.gang $(BENCH_GANG_ARGS)
# Priority preemption plans in the core (docs/benchmarks.md, "Preemption"): one JSON line per size.
bench-preempt: $(STAMP)
	$(BIN)/python -m bench.preemption
# The core with fractional GPUs: 10,000 nodes, 30 % share requests (docs/benchmarks.md, "Shares").
bench-shares: $(STAMP)
	$(BIN)/python -m bench.shares
# MIG decisions in the core by fleet size, 10 to 10,000 MIG nodes (docs/sharing.md, "MIG").
bench-mig: $(STAMP)
	$(BIN)/python -m bench.mig

# The running system end to end (docs/benchmarks.md, "Running system (end to end)"): NATS as
# the chart installs it (3 servers, TLS, auth callout; --profile dev: one plain server),
# inventory, allocator, a simulated fleet and a Prometheus as processes; one JSON line.
BENCH_E2E_ARGS ?= --nodes 1000 --requests 5000
bench-e2e: $(STAMP) prometheus
	$(BIN)/tandem loadtest $(BENCH_E2E_ARGS)

# Claims and reservations in the core with the planner's claim book (docs/benchmarks.md,
# "Claims and reservations"): 10,000 nodes, one JSON line.
bench-claims: $(STAMP)
	$(BIN)/python -m bench.claims

# How long `tandem` commands take from exec to exit (docs/benchmarks.md, "CLI start-up").
bench-cli: $(STAMP)
	$(BIN)/python -m bench.cli_startup

# The chaos suite for long (docs/reliability.md): a 3-server NATS cluster, inventory, two
# allocators and a simulated fleet as processes; one SIGKILL a round under load, invariants
# read from KV after each round; one JSON line. `make test` runs 4 rounds of the same.
SOAK_DURATION ?= 1800
SOAK_SEED ?= 1
SOAK_ARGS ?=
soak: $(STAMP)
	$(BIN)/tandem chaos --duration $(SOAK_DURATION) --seed $(SOAK_SEED) $(SOAK_ARGS)

gpu-check: $(STAMP)
	$(BIN)/tandem gpu-check

image:
	@test -n "$(VERSION)" || { echo "make image: no version in pyproject.toml" >&2; exit 1; }
	@test -n "$(BUILDER)" || { echo "make image: needs docker (with a running daemon), podman or buildah" >&2; exit 1; }
	$(BUILDER) $(if $(filter buildah,$(BUILDER)),bud,build) --file Dockerfile --tag $(IMAGE):$(VERSION) \
		--build-arg BASE=$(BASE) --build-arg VERSION=$(VERSION) --build-arg REVISION=$(REVISION) \
		$(IMAGE_BUILD_FLAGS) .

# The real platform (tests/cluster, docs/kubernetes.md "Tested for real"): kube-apiserver,
# kube-scheduler, kube-controller-manager, etcd, kwok and Jaeger built with Go from the versions
# pinned under tests/cluster/tools and cached in .cache/cluster (TANDEM_CLUSTER_CACHE); the
# chart installed into it with the Helm SDK, the services run as local processes. Needs root.
cluster-bins: $(STAMP)
	$(BIN)/python -m tests.cluster.build etcd kube-apiserver kube-controller-manager kube-scheduler kwok jaeger

cluster-test: cluster-bins
	$(BIN)/pytest -q -m cluster tests/cluster

# Pods create -> bound through the real API server: Tandem's path beside kube-scheduler alone
# at 1,000 and 5,000 kwok nodes (docs/benchmarks.md, "Through the real API"); one JSON line per
# configuration. Needs root, like cluster-test. BENCH_KUBE_ARGS="--config NODES:PODS" for others.
BENCH_KUBE_ARGS ?=
bench-kube: cluster-bins
	$(BIN)/python -m bench.kube $(BENCH_KUBE_ARGS)

# DRA claims allocated by kube-scheduler alone (matchAttribute pcieRoot) beside Tandem, on the same
# kwok fleet (built-in and real 8-GPU servers) with the same ResourceSlices and pods, filled to
# 85 % and churned to 95 % (docs/benchmarks.md, "DRA side by side"); one JSON line per fleet size
# and way. Needs root. BENCH_DRA_ARGS="--nodes 500" for one size; --mix KIND=SHARE,... or --kind;
# --stage-limit 1200 cuts each stage after 20 min (at 5,000 nodes the scheduler alone takes hours).
BENCH_DRA_ARGS ?=
bench-dra: cluster-bins
	$(BIN)/python -m bench.dra $(BENCH_DRA_ARGS)

# Jaeger v2 all-in-one for `tandem up --jaeger` (built from its Go module like the above).
jaeger: $(STAMP)
	$(BIN)/python -m tests.cluster.build jaeger

# Builds the image on a locally bootstrapped Debian base and runs the rendered chart's
# workloads from it under podman (tests/image; needs root, installs podman & co. with apt-get).
image-test: $(STAMP)
	$(BIN)/pytest -s -m image tests/image

# Prometheus and promtool (Debian package `prometheus`) for tests/prometheus: installed with
# apt-get when missing (needs root); the tests install it the same way themselves (conftest).
# policy-rc.d keeps the package from starting its own server on :9090.
prometheus:
	@if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then \
		prometheus --version 2>&1 | head -1; \
	else \
		made=; if [ ! -e /usr/sbin/policy-rc.d ]; then \
			printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && made=1; fi; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; \
		rc=$$?; if [ -n "$$made" ]; then rm -f /usr/sbin/policy-rc.d; fi; exit $$rc; \
	fi

# promtool check/test of the chart's alert rules, and a real Prometheus scraping `tandem up`.
prometheus-test: $(STAMP) prometheus
	$(BIN)/pytest -q tests/prometheus

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
