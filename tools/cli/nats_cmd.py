"""``tandem nats-config``: a nats-server ``authorization`` block with one user per component.

The permissions come from :mod:`schemas.permissions` (least privilege, derived from the
subject contract): ``allocator``, ``inventory``, ``admission``, ``cli`` and one
``nodeagent-<node>`` user per node name given. An operator running a static NATS includes the
block in the server config and gives each component its URL with user and password, e.g.
``TANDEM_NATS_URL=nats://nodeagent-gpu-1:<password>@nats:4222`` (the services take the
user's private inbox prefix from the user in the URL).

Passwords are generated (32 letters and digits, so they need no escaping in a URL) unless the
credentials file already holds one for the user: re-running with more nodes keeps the
passwords already handed out. The credentials file (YAML, written with mode 0600) maps each
user to its password and, with ``--server``, to its ready-to-use ``nats_url``.

``--auth-callout DIR`` writes the server side of auth callout instead (no user per node at
all): the issuer seed, the callout's own user seed and the ``server.conf`` that names their
public keys. With ``--secret NAMESPACE/NAME`` it also keeps those files in a Kubernetes Secret,
which is how the Helm chart's install hook makes them once, before NATS starts: keys already in
the Secret are kept (and copied into DIR first), missing ones are generated and added, and
``server.conf`` is rewritten from the kept keys.
"""

from __future__ import annotations

import argparse
import base64
import os
import string
import sys
import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tools.cli.errors import CliError

if TYPE_CHECKING:
    from schemas import permissions
    from services.kube.client import KubeClient

_ALPHABET = string.ascii_letters + string.digits
CONTROL_PLANE = ("allocator", "inventory", "admission", "cli")


def register(sub: Any) -> None:
    p = sub.add_parser(
        "nats-config",
        help="nats-server users with least-privilege permissions, one per component and node",
    )
    p.add_argument("--node", action="append", default=[], metavar="NAME", help="a GPU node (repeatable)")
    p.add_argument("--nodes-file", type=Path, help="file with node names, one a line (# comments)")
    p.add_argument("--out", type=Path, help="write the authorization block here (default: stdout)")
    p.add_argument(
        "--credentials",
        type=Path,
        help="YAML of user -> password (+ nats_url); existing passwords in it are kept",
    )
    p.add_argument("--server", help="NATS URL the components use (nats://host:4222), for nats_url")
    p.add_argument(
        "--auth-callout",
        type=Path,
        metavar="DIR",
        help="instead of static users: write DIR/server.conf (accounts + auth_callout), the issuer "
        "seed DIR/issuer.nk and the callout's user seed DIR/auth.nk for `python -m services.authcallout`; "
        "kept if present",
    )
    p.add_argument(
        "--secret",
        metavar="NAMESPACE/NAME",
        help="with --auth-callout: keep the three files in this Kubernetes Secret (in-cluster "
        "service account, else the kubeconfig); keys already in it are kept, missing ones added",
    )
    p.set_defaults(func=_run, light=True)


def _node_names(args: argparse.Namespace) -> list[str]:
    names = list(args.node)
    if args.nodes_file:
        try:
            text = args.nodes_file.read_text()
        except OSError as exc:
            raise CliError(f"{args.nodes_file}: cannot read: {exc.strerror}") from None
        names += [ln.split("#", 1)[0].strip() for ln in text.splitlines()]
    names = list(dict.fromkeys(n for n in names if n))
    for n in names:
        # Kubernetes node names are DNS subdomains; anything else cannot be a subject token.
        if not all(c.isascii() and (c.isalnum() or c in ".-") for c in n) or n.lower() != n:
            raise CliError(f"node name {n!r}: expected a Kubernetes node name ([a-z0-9.-])")
    return names


def _existing(path: Path | None) -> dict[str, str]:
    import yaml

    if path is None or not path.exists():
        return {}
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise CliError(f"{path}: cannot read credentials: {exc}") from None
    if not isinstance(data, dict):
        raise CliError(f"{path}: expected a mapping of user -> {{password: ...}}")
    out = {}
    for user, entry in data.items():
        pw = entry.get("password") if isinstance(entry, dict) else None
        if not isinstance(pw, str) or not pw:
            raise CliError(f"{path}: user {user!r} has no password")
        out[str(user)] = pw
    return out


def _url(server: str, user: str, password: str) -> str:
    parts = urllib.parse.urlsplit(server)
    if not parts.hostname:
        raise CliError(f"--server {server!r}: expected a URL such as nats://nats:4222")
    netloc = f"{user}:{password}@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit((parts.scheme or "nats", netloc, parts.path, "", ""))


def build_users(nodes: list[str], passwords: dict[str, str]) -> list[permissions.User]:
    """One user per control-plane role and per node; passwords reused or generated."""
    import secrets

    from schemas import permissions

    roles: list[tuple[str, str | None]] = [(r, None) for r in CONTROL_PLANE]
    roles += [("nodeagent", n) for n in nodes]
    users = []
    for role, node in roles:
        name = permissions.user_name(role, node=node)
        password = passwords.get(name) or "".join(secrets.choice(_ALPHABET) for _ in range(32))
        users.append(permissions.User(name, password, permissions.for_role(role, node=node)))
    return users


def _write_private(path: Path, text: str) -> None:
    # Created 0600 from the start: the file holds every component's password.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _run(args: argparse.Namespace) -> int:
    import yaml

    from schemas import permissions

    if args.secret and not args.auth_callout:
        raise CliError("--secret needs --auth-callout DIR (the files it keeps)")
    if args.auth_callout:
        if args.secret:
            import asyncio  # here: `tandem --help` imports no asyncio (tests/unit/test_cli_parser.py)

            namespace, name = _secret_ref(args.secret)
            return asyncio.run(_callout_in_secret(args.auth_callout, namespace, name))
        return _callout(args.auth_callout)
    nodes = _node_names(args)
    if not nodes:
        raise CliError("no node names: give --node NAME (repeatable) or --nodes-file FILE")
    users = build_users(nodes, _existing(args.credentials))
    block = (
        f"# Tandem NATS users ({len(nodes)} node(s)); generated by `tandem nats-config`.\n"
        + permissions.authorization_block(users)
    )
    if args.credentials:
        creds: dict[str, dict[str, str]] = {}
        for u in users:
            creds[u.name] = {"password": u.password}
            if args.server:
                creds[u.name]["nats_url"] = _url(args.server, u.name, u.password)
        _write_private(args.credentials, yaml.safe_dump(creds, sort_keys=False))
    if args.out:
        _write_private(args.out, block)
        print(f"wrote {args.out} ({len(users)} users)", file=sys.stderr)
    else:
        sys.stdout.write(block)
    return 0


def _callout(directory: Path) -> int:
    """The server side of per-component, per-node identities (services.authcallout): no user
    per node is written anywhere; the callout turns each component's service-account token
    into its permissions. Existing keys are kept, so re-running changes nothing."""
    issuer = _write_callout_files(directory)
    print(f"wrote {directory}/server.conf, issuer.nk, auth.nk (issuer {issuer})", file=sys.stderr)
    return 0


# The files of --auth-callout: the server's config block, and the two seeds whose public keys
# it names (kept once generated: new keys mean restarting NATS and the callout).
CALLOUT_FILES = ("server.conf", "issuer.nk", "auth.nk")
CALLOUT_KEYS = ("issuer.nk", "auth.nk")


def _secret_ref(ref: str) -> tuple[str, str]:
    namespace, _, name = ref.partition("/")
    if not namespace or not name or "/" in name:
        raise CliError(f"--secret {ref!r}: expected NAMESPACE/NAME")
    return namespace, name


async def _callout_in_secret(directory: Path, namespace: str, name: str) -> int:
    from services.kube.client import KubeClient
    from services.kube.errors import KubeError

    try:
        kube = await KubeClient.connect()
    except Exception as exc:  # no in-cluster account and no usable kubeconfig
        raise CliError(f"--secret: cannot reach the Kubernetes API: {exc}") from None
    try:
        outcome = await store_callout_secret(kube, directory, namespace=namespace, name=name)
    except KubeError as exc:
        raise CliError(f"--secret {namespace}/{name}: {exc}") from None
    finally:
        await kube.close()
    print(f"Secret {namespace}/{name}: {outcome}", file=sys.stderr)
    return 0


async def store_callout_secret(kube: KubeClient, directory: Path, *, namespace: str, name: str) -> str:
    """Make ``directory``'s callout files agree with Secret ``namespace/name``; returns what was
    done (``created``, ``added <keys>``, ``unchanged``). The Secret's keys win over the files:
    a key that exists is never replaced, so every run of the hook leaves the issuer as it was."""
    import asyncio

    from services.kube.errors import Conflict, NotFound

    for attempt in (1, 2):  # a concurrent create (409) is read back and joined once
        try:
            current = (await kube.get_secret(namespace, name)).get("data") or {}
            exists = True
        except NotFound:
            current, exists = {}, False
        data = await asyncio.to_thread(_files_from_secret, directory, current)
        if not exists:
            labels = {"app.kubernetes.io/part-of": "tandem", "app.kubernetes.io/component": "nats-auth"}
            body = {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": name, "namespace": namespace, "labels": labels},
                "type": "Opaque",
                "data": data,
            }
            try:
                await kube.create_secret(namespace, body)
            except Conflict:
                if attempt == 2:
                    raise
                continue
            return "created"
        changed = {k: v for k, v in data.items() if current.get(k) != v}
        if not changed:
            return "unchanged"
        await kube.patch_secret(namespace, name, {"data": changed})
        return f"updated {', '.join(sorted(changed))}"
    raise AssertionError("unreachable")


def _files_from_secret(directory: Path, current: dict[str, str]) -> dict[str, str]:
    """Copy the Secret's keys into ``directory``, generate what is missing; the files as the
    Secret's base64 ``data``."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for key in CALLOUT_KEYS:
            if key in current:
                _write_private(directory / key, base64.b64decode(current[key]).decode())
        _write_callout_files(directory)
        return {k: base64.b64encode((directory / k).read_bytes()).decode() for k in CALLOUT_FILES}
    except OSError as exc:
        raise CliError(f"{directory}: cannot write: {exc.strerror}") from None


def _write_callout_files(directory: Path) -> str:
    """Write (or keep) the seeds DIR/issuer.nk (account key: signs the users the callout hands
    out) and DIR/auth.nk (user key: the callout's own login), and DIR/server.conf naming their
    public keys; return the issuer's public key."""
    import nkeys

    from schemas import permissions
    from services.authcallout import natsjwt

    try:
        directory.mkdir(parents=True, exist_ok=True)
        seeds = {"issuer.nk": nkeys.PREFIX_BYTE_ACCOUNT, "auth.nk": nkeys.PREFIX_BYTE_USER}
        for name, role in seeds.items():
            if not (directory / name).exists():
                _write_private(directory / name, natsjwt.new_seed(role).decode() + "\n")
        public = {}
        for name in seeds:
            try:
                public[name] = natsjwt.public_key((directory / name).read_bytes())
            except natsjwt.JwtError as exc:
                raise CliError(f"{directory / name}: {exc}") from None
        block = "# Tandem auth callout; generated by `tandem nats-config --auth-callout`.\n"
        block += permissions.callout_block(issuer=public["issuer.nk"], auth_nkey=public["auth.nk"])
        _write_private(directory / "server.conf", block)
    except OSError as exc:
        raise CliError(f"{directory}: cannot write: {exc.strerror}") from None
    return public["issuer.nk"]
