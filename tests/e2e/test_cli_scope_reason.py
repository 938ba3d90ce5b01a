"""Which scope, and why a weaker one: `tandem submit` and `tandem explain` against a real
`tandem up` (issue "The first hour", item 8).

On an empty mixed cluster a 2 GPUs + 2 NICs request goes, with the default node order
(``alignment-first``), to a DGX server, where both pairs share a PCIe switch, not to a PCIe
box that could pair one across its root complex. A class with ``node_order: used-first`` goes
to the smallest free server instead (it keeps the big servers whole for large aligned jobs;
docs/benchmarks.md, "Node order"); the person who asked for ``pcie-switch`` is told so, and
how to choose otherwise. When no node can pair at the asked scope, the note says why.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_cli_requests import tandem
from tests.e2e.test_cli_up import start_up

pytestmark = pytest.mark.integration


def test_by_default_two_pairs_go_where_they_share_a_switch() -> None:
    with start_up("pcie-4gpu-2nic:1:pcie", "dgx-h100:1:h100") as url:
        sent = tandem(url, "submit", "--pod", "t/two", "--gpus", "2", "--rdma", "2", "--wait")
        assert "assigned: node h100-0, scope pcie-switch" in sent.stdout, sent.stdout
        assert "not as asked" not in sent.stdout, sent.stdout
        rest = tandem(url, "submit", "--pod", "t/six", "--gpus", "6", "--rdma", "6", "--wait")
        assert "assigned: node h100-0, scope pcie-switch" in rest.stdout, rest.stdout
        # The DGX is full: the PCIe box is all that is left, and the note says why.
        late = tandem(url, "submit", "--pod", "t/late", "--gpus", "2", "--rdma", "2", "--wait")
        assert "assigned: node pcie-0, scope pcie-root" in late.stdout, late.stdout
        why = (
            "scope pcie-root, not as asked: no node could pair at pcie-switch now (1 node: 2 GPUs "
            "free but only 1 NICs under their PCIe switches; 1 node: fewer than 2 free GPUs)"
        )
        assert why in late.stdout, late.stdout
        told = tandem(url, "explain", "--pod", "t/late")
        assert why.replace("scope ", "scope    ", 1) in told.stdout, told.stdout


def test_submit_and_explain_say_why_the_scope_is_weaker_than_asked(tmp_path: Path) -> None:
    config = tmp_path / "used-first.yaml"
    config.write_text("device_classes:\n  default: {node_order: used-first}\n")
    with start_up("pcie-4gpu-2nic:1:pcie", "dgx-h100:1:h100", args=("--config", str(config))) as url:
        sent = tandem(url, "submit", "--pod", "t/two", "--gpus", "2", "--rdma", "2", "--wait")
        assert sent.returncode == 0, sent.stderr
        assert "assigned: node pcie-0, scope pcie-root" in sent.stdout, sent.stdout
        why = (
            "scope pcie-root, not as asked: pcie-switch pairs were possible on h100-0, a server not "
            "in use: the class 'default' places on servers in use, else on the smallest free one "
            "(node_order: used-first)"
        )
        assert why in sent.stdout, sent.stdout
        told = tandem(url, "explain", "--pod", "t/two")
        assert told.returncode == 0, told.stderr
        assert "scope    pcie-root, not as asked: pcie-switch pairs were possible on h100-0" in told.stdout
        assert "node_order: alignment-first puts alignment first, as classes do by default" in told.stdout
        # A request that met its scope says nothing of the kind.
        met = tandem(url, "submit", "--pod", "t/one", "--gpus", "1", "--rdma", "1", "--wait")
        assert met.returncode == 0 and "not as asked" not in met.stdout, met.stdout
