"""The production profile of ``tandem loadtest``: NATS as the chart installs it.

The chart's default (``deploy/helm/tandem/values.yaml``): a three-server JetStream cluster
(``nats.replicas: 3``, every stream and bucket replicated on all three), TLS on the client port
and between the servers, and every connection authorized by the auth callout
(``nats.auth.mode: callout``). Here, for one run, in the run directory:

* **PKI**: a CA and one certificate for 127.0.0.1 that every server presents, to clients and
  to its routes (both ends of a route verify it, as in the chart), made with ``openssl``;
* **networks**, only for a run that cuts a server off (``--partition-server-at``): each server
  in a network namespace of its own (:mod:`services.runtime.process.podnet`), reached through
  this machine as three machines would be, its address in the certificate too;
* **keys and server config**: the callout's issuer (account) seed and its own user seed, and
  the ``server.conf`` of :func:`schemas.permissions.callout_block`, as ``tandem nats-config
  --auth-callout`` writes them, plus ``tls`` and ``cluster.tls`` blocks;
* **identities**: a service-account token per component (allocator, inventory) and one per
  simulated node, bound to a pod on that node (:mod:`tools.loadtest.tokenreview` answers their
  reviews: the one Kubernetes boundary faked). Each node connects with its own token and gets
  only its node's subjects (:mod:`tools.loadtest.fleet`, ``--token-dir``);
* **the harness's own connection** (ceiling, driver, checker, ledger — the measuring
  instruments, not a component) is a trusted nkey user of the ``TANDEM`` account that
  bypasses the callout, so that its reads of every record need no role.

:meth:`Production.security` checks, before the load, that the servers really refuse a plain
connection and a TLS connection without a token; the report carries what it found.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from dataclasses import dataclass
from pathlib import Path

import msgspec
import nats
import nats.errors
import nkeys

from schemas import permissions
from services.authcallout import natsjwt
from services.runtime.errors import EmbeddedServerError
from services.runtime.nats.auth import tls_context
from services.runtime.process.embedded import EmbeddedNatsCluster
from services.runtime.process.podnet import PodNetwork, PodNetworkError, forwarding_back, forwarding_on
from services.runtime.settings import Settings
from tools.loadtest.errors import LoadtestError
from tools.loadtest.procs import Child, Children
from tools.loadtest.report import Security
from tools.loadtest.tokenreview import TokenReviews, token_review_server

NAMESPACE = "tandem"
SERVERS = 3  # values.yaml nats.replicas; streams and buckets replicated on all (stream_replicas)
ACCOUNTS = {"allocator": "tandem-allocator", "inventory": "tandem-inventory"}
CONNECT_CHECK_S = 5.0
CALLOUT_READY_S = 60.0
# The servers' own networks (--partition-server-at): /30s of 10.232.0.0/16, names starting "tl".
NETWORK_SECOND = 232


@dataclass(frozen=True)
class Pki:
    ca: Path
    cert: Path
    key: Path


def _openssl(*args: str) -> None:
    try:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)
    except FileNotFoundError as exc:
        raise LoadtestError("the production profile needs openssl for its TLS certificates") from exc
    except subprocess.CalledProcessError as exc:
        raise LoadtestError(
            f"openssl {args[0]} failed: {exc.stderr.decode(errors='replace')[-300:]}"
        ) from exc


def make_pki(directory: Path, *, ips: tuple[str, ...] = ()) -> Pki:
    """A CA and a certificate for 127.0.0.1/localhost (and ``ips``) signed by it (server and
    client use: routes present it to each other)."""
    d = directory
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    ca, ca_key = str(d / "ca.crt"), str(d / "ca.key")
    _openssl(
        "req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", "2", "-subj", "/CN=tandem-loadtest-ca"
    )
    _openssl("req", *ec, "-keyout", str(d / "tls.key"), "-out", str(d / "tls.csr"), "-subj", "/CN=nats")
    (d / "tls.ext").write_text(
        f"subjectAltName={','.join(f'IP:{ip}' for ip in ('127.0.0.1', *ips))},DNS:localhost\n"
        "extendedKeyUsage=serverAuth,clientAuth\n"
    )
    signed = ["-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-days", "2", "-extfile", str(d / "tls.ext")]
    _openssl("x509", "-req", "-in", str(d / "tls.csr"), "-out", str(d / "tls.crt"), *signed)
    return Pki(ca=d / "ca.crt", cert=d / "tls.crt", key=d / "tls.key")


def server_config(pki: Pki, *, issuer: str, auth_nkey: str, harness_nkey: str) -> str:
    """What every server reads beside its flags: TLS for clients and routes (the chart's
    ``nats.conf``), then the callout's accounts and authorization."""
    tls = f'cert_file: "{pki.cert}"\n  key_file: "{pki.key}"\n  timeout: 5\n'
    return (
        f"tls {{\n  {tls}}}\n"
        f'cluster {{\n  tls {{\n  {tls}  ca_file: "{pki.ca}"\n  }}\n}}\n'
        + permissions.callout_block(issuer=issuer, auth_nkey=auth_nkey, trusted_nkeys=[harness_nkey])
    )


def _write_private(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


class Production:
    """Keys, certificates, tokens and the three servers of one production-profile run."""

    def __init__(self, run_dir: Path, settings: Settings, *, isolated: bool = False) -> None:
        self.dir = run_dir / "production"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.settings = settings
        self.reviews = TokenReviews(namespace=NAMESPACE, audience=settings.auth_audience, keep_reviews=False)
        self.cluster: EmbeddedNatsCluster | None = None
        self.pki: Pki | None = None
        self.apiserver_url = ""
        self._apiserver: contextlib.AbstractAsyncContextManager[str] | None = None
        self.seeds: dict[str, Path] = {}
        self.isolated = isolated  # each server in a network namespace of its own
        self.networks: list[PodNetwork] = []
        self._forwarding = ""

    @property
    def url(self) -> str:
        assert self.cluster is not None
        return self.cluster.url

    @property
    def replicas(self) -> int:
        """Replicas of every stream and bucket: one per server, as the chart's bundled NATS."""
        return SERVERS

    async def start(self) -> str:
        """Certificates, keys, the TokenReview endpoint and the three servers; their URLs."""
        if self.isolated:
            await asyncio.to_thread(self._networks)
        ips = tuple(net.pod_ip for net in self.networks)
        self.pki = pki = await asyncio.to_thread(make_pki, self.dir, ips=ips)
        public = {}
        for name, prefix in (
            ("issuer", nkeys.PREFIX_BYTE_ACCOUNT),
            ("auth", nkeys.PREFIX_BYTE_USER),
            ("harness", nkeys.PREFIX_BYTE_USER),
        ):
            seed = natsjwt.new_seed(prefix)
            self.seeds[name] = _write_private(self.dir / f"{name}.nk", seed.decode() + "\n")
            public[name] = natsjwt.public_key(seed)
        conf = _write_private(
            self.dir / "server.conf",
            server_config(
                pki, issuer=public["issuer"], auth_nkey=public["auth"], harness_nkey=public["harness"]
            ),
        )
        self._apiserver = token_review_server(self.reviews)
        self.apiserver_url = await self._apiserver.__aenter__()
        (self.dir / "kubeconfig").write_text(_kubeconfig(self.apiserver_url))
        self.cluster = EmbeddedNatsCluster(
            size=SERVERS,
            base_dir=str(self.dir / "nats"),
            config_file=str(conf),
            scheme="tls",
            networks=self.networks or None,
        )
        try:
            await asyncio.to_thread(self.cluster.start)
        except EmbeddedServerError as exc:
            self.cluster = None
            raise LoadtestError(f"nats cluster (production profile): {str(exc).splitlines()[0]}") from exc
        return self.url

    def _networks(self) -> None:
        """A namespace per server; forwarding on, since they reach each other through here."""
        self._forwarding = forwarding_on()
        try:
            for _ in range(SERVERS):
                self.networks.append(PodNetwork.create(second=NETWORK_SECOND, prefix="tl"))
        except PodNetworkError as exc:
            raise LoadtestError(f"--partition-server-at: network namespaces for the servers: {exc}") from exc

    def _delete_networks(self) -> None:
        for net in self.networks:
            net.delete()
        self.networks = []
        if self._forwarding:
            forwarding_back(self._forwarding)
            self._forwarding = ""

    def server_pids(self) -> list[int]:
        if self.cluster is None:
            return []
        return [m.proc.pid for m in self.cluster.members if m.proc is not None and m.proc.poll() is None]

    # -- what each process connects with ------------------------------------------------------

    def _tls(self) -> dict[str, object]:
        assert self.pki is not None
        return {"nats_tls_ca": str(self.pki.ca)}

    def component(self, role: str) -> dict[str, object]:
        """Config keys of a component: its own service-account token, the CA."""
        token = _write_private(self.dir / f"token-{role}", self.reviews.issue(ACCOUNTS[role]) + "\n")
        return {**self._tls(), "nats_token_file": str(token), "stream_replicas": SERVERS}

    def harness(self) -> dict[str, object]:
        """Config keys of the harness's measuring processes (checker, ledger) and of itself."""
        return {**self._tls(), "nats_nkey_seed": str(self.seeds["harness"])}

    async def start_callout(self, children: Children, base: dict[str, object], *, port: int) -> Child:
        """``python -m services.authcallout`` as the chart runs it (its own nkey user, the
        issuer seed), with a kubeconfig naming the TokenReview endpoint; once it is ready."""
        config = {
            **base,
            **self._tls(),
            "ops_port": port,
            "nats_nkey_seed": str(self.seeds["auth"]),
            "auth_issuer_seed_file": str(self.seeds["issuer"]),
            "auth_namespace": NAMESPACE,
        }
        env = {"TANDEM_INSTANCE": "authcallout-0", "KUBECONFIG": str(self.dir / "kubeconfig")}
        callout = await children.spawn(
            "callout", role="callout", module="services.authcallout", config=config, env=env
        )
        await children.wait_ready(callout, timeout=CALLOUT_READY_S)
        return callout

    def fleet(self) -> dict[str, object]:
        """The fleet's config keys: the CA (each node's token comes with :meth:`node_tokens`)."""
        return self._tls()

    def node_tokens(self, names: list[str]) -> Path:
        """A directory with one token file per node (named after the node), bound to a pod on
        that node."""
        tokens = self.dir / "node-tokens"
        tokens.mkdir(exist_ok=True)
        for node in names:
            token = self.reviews.issue("tandem-nodeagent", node=node, pod=f"tandem-nodeagent-{node}")
            _write_private(tokens / node, token + "\n")
        return tokens

    # -- checks -------------------------------------------------------------------------------

    async def security(self) -> Security:
        """Try what must fail — a plain connection, and a TLS one without a token — and raise
        when either gets in; what was seen, for the report."""
        assert self.cluster is not None
        host, port = self.cluster.members[0].host, self.cluster.members[0].port
        plain = not await _connects([f"nats://{host}:{port}"])
        ctx = tls_context(
            msgspec.structs.replace(self.settings, nats_url=self.url, nats_tls_ca=str(self._ca()))
        )
        no_token = not await _connects([f"tls://{host}:{port}"], tls=ctx)
        seen = Security(tls=True, auth="callout", plain_refused=plain, no_token_refused=no_token)
        if not (plain and no_token):
            raise LoadtestError(f"the servers let in what they must refuse ({seen}): see {self.dir}")
        return seen

    def _ca(self) -> Path:
        assert self.pki is not None
        return self.pki.ca

    def kill_now(self) -> None:
        """The CLI's last resort (the event loop is gone): stop the servers."""
        if self.cluster is not None:
            self.cluster.stop()
        self._delete_networks()

    async def stop(self) -> None:
        if self.cluster is not None:
            await asyncio.to_thread(self.cluster.stop)
        await asyncio.to_thread(self._delete_networks)
        if self._apiserver is not None:
            with contextlib.suppress(Exception):
                await self._apiserver.__aexit__(None, None, None)


async def _connects(servers: list[str], **opts: object) -> bool:
    """Whether a client gets a connection (one attempt, no reconnects)."""
    try:
        nc = await asyncio.wait_for(
            nats.connect(
                servers=servers,
                allow_reconnect=False,
                max_reconnect_attempts=0,
                connect_timeout=2,
                error_cb=_quiet,
                **opts,
            ),
            CONNECT_CHECK_S,
        )
    except (TimeoutError, OSError, nats.errors.Error):
        return False
    await nc.close()
    return True


async def _quiet(exc: Exception) -> None:
    """The refusal is the expected outcome: nothing to log (nats-py would print a traceback)."""


def _kubeconfig(server: str) -> str:
    return (
        "apiVersion: v1\nkind: Config\ncurrent-context: loadtest\n"
        f"clusters:\n- name: loadtest\n  cluster:\n    server: {server}\n"
        "users:\n- name: loadtest\n  user: {}\n"
        "contexts:\n- name: loadtest\n  context:\n    cluster: loadtest\n    user: loadtest\n"
    )
