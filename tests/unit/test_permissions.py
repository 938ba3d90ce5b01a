"""schemas.permissions and ``tandem nats-config`` without a server (the server side is in
tests/integration/test_permissions.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
import yaml

from schemas import permissions, routing, subjects
from schemas.messages import AllocationRequest, Freed, PodRef
from tools.cli.main import main as cli_main


@pytest.fixture(autouse=True)
def keep_logging_config() -> Iterator[None]:
    """``tandem`` configures structlog to print to the stderr of the moment, which in a test is
    pytest's capture file, closed afterwards; put the configuration back for later tests."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def all_subjects(p: permissions.Permissions) -> list[str]:
    return [*p.publish, *p.subscribe]


def test_node_agent_is_confined_to_its_own_node() -> None:
    mine, other = "gpu-1.example", "gpu-2.example"
    p = permissions.nodeagent(mine)
    assert subjects.node_heartbeat(mine) in p.publish and subjects.node_cleaned(mine) in p.publish
    assert subjects.node_command(mine) in p.subscribe
    assert f"$JS.API.DIRECT.GET.KV_tandem-allocs.$KV.tandem-allocs.{mine}" in p.publish
    # It follows its record on the republish subject; it owns no consumer at all.
    assert subjects.node_allocs(mine) in p.subscribe
    assert not any(".CONSUMER." in s for s in p.publish)
    for s in all_subjects(p):
        assert other not in s and subjects.node_token(other) not in s, s
        assert "*" not in s, s  # no wildcard that could stand for another node
    # No provisioning, no reading every key, no broad inbox.
    assert not any(".STREAM.CREATE." in s or ".STREAM.UPDATE." in s for s in p.publish)
    assert not any("STREAM.MSG.GET" in s or s.endswith("$KV.tandem-allocs.>") for s in p.publish)
    assert p.subscribe[-1] == f"_INBOX_nodeagent-{subjects.node_token(mine)}.>"
    assert p.allow_responses  # it answers device commands


def test_no_role_gets_the_legacy_durable_create_or_a_catch_all() -> None:
    roles = [permissions.for_role(r) for r in permissions.ROLES if r != "nodeagent"]
    for p in [*roles, permissions.nodeagent("n1")]:
        for s in all_subjects(p):
            assert "DURABLE.CREATE" not in s  # its filter is in the body, not the subject
            assert s not in {">", "tandem.>", "$JS.>", "$JS.API.>", "_INBOX.>"}


def test_only_control_plane_services_provision() -> None:
    create = "$JS.API.STREAM.CREATE.TANDEM_ALLOC"
    control = [r for r in permissions.ROLES if r != "nodeagent"]
    provisioners = {r for r in control if create in permissions.for_role(r).publish}
    assert provisioners == {"allocator", "inventory", "admission"} == permissions.PROVISIONERS


def test_roles_follow_the_subject_contract() -> None:
    alloc = permissions.allocator()
    assert subjects.ALLOC_ASSIGNED_ALL in alloc.publish and "$KV.tandem-allocs.>" in alloc.publish
    assert "$KV.tandem-nodes.>" not in alloc.publish  # inventory owns node records
    inv = permissions.inventory()
    assert subjects.NODE_HEARTBEAT_ALL in inv.subscribe and inv.allow_responses
    cli = permissions.cli()
    assert not any(s.startswith("$KV.") for s in cli.publish)  # reads records, never writes


def test_only_allocators_hand_requests_to_each_other() -> None:
    alloc = permissions.allocator()
    forward = subjects.ALLOCATOR_FORWARD_ALL
    assert forward in alloc.publish and forward in alloc.subscribe
    assert alloc.allow_responses  # a replica answers what another handed it
    for role in permissions.ROLES:
        if role not in ("allocator", "nodeagent"):
            p = permissions.for_role(role)
            assert not any(s.startswith("tandem.allocator.forward") for s in all_subjects(p)), role
    assert subjects.allocator_forward("allocator-0") == "tandem.allocator.forward.allocator-0"
    assert subjects.allocator_forward("a.b c*>") == "tandem.allocator.forward.a_b_c__"  # one token


def test_unknown_role_and_missing_node_are_errors() -> None:
    with pytest.raises(permissions.PermissionsError, match="unknown role 'scheduler'"):
        permissions.for_role("scheduler")
    with pytest.raises(permissions.PermissionsError, match="node name"):
        permissions.for_role("nodeagent")


def test_authorization_block_quotes_every_subject() -> None:
    user = permissions.User("nodeagent-n1", "pw", permissions.nodeagent("n1"))
    text = permissions.authorization_block([user])
    assert text.startswith("authorization {\n  users = [")
    assert '"$JS.API.STREAM.INFO.KV_tandem-allocs"' in text  # quoted: $ is not a variable
    assert "allow_responses: true" in text and 'password: "pw"' in text


def test_nats_config_keeps_passwords_and_adds_nodes(tmp_path: Path) -> None:
    conf, creds = tmp_path / "auth.conf", tmp_path / "creds.yaml"
    base = ["nats-config", "--out", str(conf), "--credentials", str(creds), "--server", "nats://nats:4222"]
    assert cli_main([*base, "--node", "gpu-1"]) == 0
    first = yaml.safe_load(creds.read_text())
    assert set(first) == {"allocator", "inventory", "admission", "cli", "nodeagent-gpu-1"}
    pw = first["nodeagent-gpu-1"]["password"]
    assert len(pw) == 32 and pw.isalnum()
    assert first["nodeagent-gpu-1"]["nats_url"] == f"nats://nodeagent-gpu-1:{pw}@nats:4222"

    nodes = tmp_path / "nodes.txt"
    nodes.write_text("gpu-1\n# spare\ngpu-2.rack3\n")
    assert cli_main([*base, "--nodes-file", str(nodes)]) == 0
    second = yaml.safe_load(creds.read_text())
    assert second["nodeagent-gpu-1"]["password"] == pw  # handed-out passwords survive
    assert "nodeagent-gpu-2_rack3" in second
    assert conf.read_text().count("user: ") == 6
    assert (creds.stat().st_mode & 0o777) == 0o600


def test_nats_config_rejects_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["nats-config"]) == 2
    assert "no node names" in capsys.readouterr().err
    assert cli_main(["nats-config", "--node", "GPU_1"]) == 2
    assert "GPU_1" in capsys.readouterr().err
    creds = tmp_path / "creds.yaml"
    creds.write_text("cli: {}\n")
    assert cli_main(["nats-config", "--node", "n1", "--credentials", str(creds)]) == 2
    assert f"{creds}: user 'cli' has no password" in capsys.readouterr().err


def test_a_hand_over_subject_carries_only_an_allocation_request() -> None:
    subject = subjects.allocator_forward("allocator-1")
    req = AllocationRequest(request_id="r", pod=PodRef("ns", "p"), gpus=1)
    assert routing.refusal(subject, req) is None
    refused = routing.refusal(subject, Freed(request_id="r", node="n"))
    assert refused is not None and "carries only 'alloc.request'" in refused
    assert routing.refusal(f"{subject}.extra", req) is not None
