"""loadtests/ingress_chain_cost.py: the ingress's own path from step messages to
SSE writes runs in one process, one write per stream per step."""
from __future__ import annotations

from loadtests import bench


def test_ingress_chain_mode_streams_every_step_and_prints_its_cost(capsys):
    result = bench.main(["ingress-chain", "--streams", "3", "--steps", "5", "--rounds", "2"])
    assert result["events"] == 3 * 4 and len(result["rounds_us"]) == 2
    assert result["us_per_event"] > 0
    assert "3 streams x 5 steps:" in capsys.readouterr().out
