"""Where the CLI exports without being told (tools/cli/localtraces.py): the user's word first,
else the record the running `tandem up` left for its NATS port on this machine, believed only
while its writer runs."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from services.runtime.settings import load_settings
from tools.cli import localtraces

URL = "nats://127.0.0.1:4781"
JAEGER = "http://127.0.0.1:4318"


@pytest.fixture(autouse=True)
def own_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_what_the_user_says_wins_and_the_record_is_read_only_without_it() -> None:
    asked: list[bool] = []

    def published() -> str:
        asked.append(True)
        return JAEGER

    collector = "http://collector:4318"
    assert localtraces.choose_endpoint(collector, published=published) == collector
    assert localtraces.choose_endpoint("", published=published) is None  # set empty: no export
    assert asked == []
    assert localtraces.choose_endpoint(None, published=published) == JAEGER
    assert asked == [True]


def test_the_variable_set_empty_is_told_apart_from_unset() -> None:
    def published() -> str:
        return JAEGER

    told = load_settings("cli", environ={"OTEL_EXPORTER_OTLP_ENDPOINT": ""}).otlp_endpoint
    unset = load_settings("cli", environ={}).otlp_endpoint
    assert (told, unset) == ("", None)
    assert localtraces.choose_endpoint(told, published=published) is None
    assert localtraces.choose_endpoint(unset, published=published) == JAEGER


@pytest.mark.parametrize(
    ("nats_url", "name"),
    [
        ("nats://127.0.0.1:4781", "up-4781.json"),
        ("127.0.0.1:5000", "up-5000.json"),
        ("nats://localhost", "up-4222.json"),
        ("nats://[::1]:4000", "up-4000.json"),
        ("nats://10.0.0.5:4222", None),  # another machine: not a `tandem up` of this one
        ("nats://nats.tandem.svc:4222", None),
        ("nats://127.0.0.1:4222,nats://127.0.0.1:4223", None),  # a cluster, not `tandem up`
        ("nats://127.0.0.1:99999", None),
    ],
)
def test_only_one_server_on_this_machine_has_a_record(nats_url: str, name: str | None) -> None:
    assert localtraces.record_name(nats_url) == name


def test_a_published_endpoint_is_found_by_its_nats_url_until_withdrawn() -> None:
    path = localtraces.publish(URL, JAEGER)
    assert path is not None and path.name == "up-4781.json"
    assert localtraces.published_endpoint(URL) == JAEGER
    assert localtraces.published_endpoint("nats://localhost:4781") == JAEGER
    assert localtraces.published_endpoint("nats://127.0.0.1:4782") is None
    localtraces.withdraw(path)
    assert localtraces.published_endpoint(URL) is None


def test_a_tandem_up_that_does_not_export_removes_an_older_record() -> None:
    assert localtraces.publish(URL, JAEGER) is not None
    assert localtraces.publish(URL, None) is None
    assert localtraces.published_endpoint(URL) is None


def test_a_record_whose_writer_stopped_or_that_is_unreadable_is_ignored() -> None:
    path = localtraces.publish(URL, JAEGER)
    assert path is not None
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    path.write_text(json.dumps({"nats_url": URL, "otlp_endpoint": JAEGER, "pid": int(gone.stdout)}))
    assert localtraces.published_endpoint(URL) is None  # a killed `tandem up` left it
    path.write_text("{not json")
    assert localtraces.published_endpoint(URL) is None
    path.write_text(json.dumps(["a list"]))
    assert localtraces.published_endpoint(URL) is None


def test_an_unwritable_directory_leaves_no_record_and_no_error(own_tmp: Path) -> None:
    (own_tmp / localtraces.record_dir().name).write_text("a file where the directory goes")
    assert localtraces.publish(URL, JAEGER) is None
    assert localtraces.published_endpoint(URL) is None
