"""The Kubernetes wrapper's watch reader, line by line (services/kube/client.py): what the
API server sends on a watch stream, and what a broken or hostile stream becomes."""

from __future__ import annotations

import json

import pytest

from services.kube.client import _watch_event
from services.kube.errors import KubeError


def line(doc: object) -> bytes:
    return json.dumps(doc).encode() + b"\n"


def test_an_event_is_its_type_and_object() -> None:
    pod = {"metadata": {"name": "p", "resourceVersion": "7"}}
    assert _watch_event(line({"type": "MODIFIED", "object": pod})) == ("MODIFIED", pod)


def test_bookmarks_and_blank_lines_are_skipped() -> None:
    bookmark = {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "9"}}}
    assert _watch_event(line(bookmark)) is None
    assert _watch_event(b"\n") is None


def test_410_gone_is_a_kube_error_with_its_status() -> None:
    """The real server answers a watch from a compacted version this way; the bridge lists
    again (tests/cluster/test_watches.py does it against kube-apiserver)."""
    status = {
        "kind": "Status",
        "status": "Failure",
        "message": "too old resource version: 1 (4242)",
        "reason": "Expired",
        "code": 410,
    }
    with pytest.raises(KubeError) as caught:
        _watch_event(line({"type": "ERROR", "object": status}))
    assert caught.value.status == 410
    assert "too old resource version" in str(caught.value)


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b'{"type": "ADDED", "object": {"metadata"', "unreadable watch event"),
        (b"not json\n", "unreadable watch event"),
        (line({"type": "ADDED"}), "without a type and an object"),
        (line({"object": {}}), "without a type and an object"),
        (line(["ADDED", {}]), "without a type and an object"),
        (line({"type": "ERROR", "object": {"code": "x", "message": "odd"}}), "odd"),
    ],
)
def test_a_broken_line_is_a_kube_error_not_a_crash(raw: bytes, says: str) -> None:
    with pytest.raises(KubeError, match=says):
        _watch_event(raw)
