"""Wire contract and settings: names, codecs, JSON Schema export, config errors."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from schemas import codec, subjects
from schemas.messages import AllocationRequest, PodRef
from services.runtime.errors import SettingsError
from services.runtime.settings import load_settings
from tools.cli.main import main


def test_node_names_with_dots_map_to_one_token_and_back() -> None:
    node = "ip-10-0-0-1.ec2.internal"
    subject = subjects.node_inventory(node)
    assert subject == "tandem.node.ip-10-0-0-1_ec2_internal.inventory"
    assert subjects.node_of(subject) == node
    assert subjects.node_of(subjects.alloc_assigned(node)) == node
    assert "." not in subjects.nodeagent_durable(node, "assigned")


def test_unknown_fields_are_ignored_so_versions_can_roll() -> None:
    req = AllocationRequest(request_id="u.1", pod=PodRef("ns", "p", "u"), gpus=1)
    wire = msgspec.msgpack.decode(codec.encode(req))
    wire["added_in_a_later_version"] = {"x": 1}
    assert codec.ALLOC_EVENT.decode(msgspec.msgpack.encode(wire)) == req


def test_schema_export_writes_one_schema_per_message(tmp_path: Path) -> None:
    assert main(["schema", "export", str(tmp_path)]) == 0
    schema = json.loads((tmp_path / "AllocationRequest.schema.json").read_text())
    props = schema["$defs"]["AllocationRequest"]["properties"]
    assert props["kind"]["enum"] == ["alloc.request"] and "gpus" in props
    assert len(list(tmp_path.glob("*.schema.json"))) >= 17


def test_bad_config_file_fails_at_start_naming_path_and_field(tmp_path: Path) -> None:
    cfg = tmp_path / "tandem.yaml"
    cfg.write_text("heartbeat_interval: soon\n")
    with pytest.raises(SettingsError, match=r"tandem\.yaml.*heartbeat_interval"):
        load_settings("allocator", config=cfg, environ={})
    cfg.write_text("no_such_key: 1\n")
    with pytest.raises(SettingsError, match="no_such_key"):
        load_settings("allocator", config=cfg, environ={})
    with pytest.raises(SettingsError, match=r"missing\.yaml"):
        load_settings("allocator", config=tmp_path / "missing.yaml", environ={})


def test_environment_overrides_file(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("node_lost_after: 5\ndevice_classes:\n  ib: {nic_link_type: infiniband, scope: numa}\n")
    s = load_settings(
        "inventory",
        config=cfg,
        environ={"TANDEM_NODE_LOST_AFTER": "9.5", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4318"},
    )
    assert s.node_lost_after == 9.5 and s.otlp_endpoint == "http://jaeger:4318"
    assert s.device_classes["ib"].scope == "numa"
