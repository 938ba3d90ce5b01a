"""The device classes a plain `tandem up` serves are the ones docs/sharing.md shows (its
"Device classes" values and the shares example's classes file), so every command of the page
runs against it; a settings file that names classes replaces them, one that does not keeps
them."""

from __future__ import annotations

from pathlib import Path

import msgspec
import yaml

from schemas.config import DeviceClass
from services.runtime.settings import load_settings
from tools.localstack import describe_classes, local_device_classes

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _classes(data: object) -> dict[str, DeviceClass]:
    return msgspec.convert(data, dict[str, DeviceClass])


def test_they_are_the_classes_of_docs_sharing() -> None:
    page = (DOCS / "sharing.md").read_text()
    block = page.split("### Device classes", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    assert local_device_classes() == _classes(yaml.safe_load(block)["deviceClasses"])
    assert local_device_classes() == _classes(
        yaml.safe_load((DOCS / "examples/shares/classes.yaml").read_text())
    )


def test_a_config_replaces_them_and_defaults_stay_otherwise(tmp_path: Path) -> None:
    defaults = {"device_classes": msgspec.to_builtins(local_device_classes())}
    plain = load_settings("tandem-up", environ={}, defaults=defaults)
    assert plain.device_classes == local_device_classes()
    config = tmp_path / "tandem.yaml"
    config.write_text("device_classes: {default: {}, a100: {gpu_models: [A100]}}\nlog_level: debug\n")
    named = load_settings("tandem-up", environ={"TANDEM_CONFIG": str(config)}, defaults=defaults)
    assert sorted(named.device_classes) == ["a100", "default"]
    other = tmp_path / "other.yaml"
    other.write_text("log_level: debug\n")
    kept = load_settings("tandem-up", config=other, environ={}, defaults=defaults)
    assert kept.device_classes == local_device_classes() and kept.log_level == "debug"


def test_described_in_one_line() -> None:
    assert describe_classes(local_device_classes()) == (
        "default (whole GPUs), shared (GPU shares: hami, at most 4 a GPU), "
        "shared-mps (GPU shares: mps, at most 2 a GPU)"
    )
