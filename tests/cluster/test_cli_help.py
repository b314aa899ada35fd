"""Every command line's --help prints (argparse formats help texts with %, so a bare
% in one, like "25% of the memory", breaks --help and nothing else)."""
from __future__ import annotations

import pytest

from cluster import serve_local
from loadtests import bench_engine, fake_server, gpu_check, soak
from loadtests.serving import serving_matrix, serving_run

PARSERS = {
    "serve_local": serve_local.parse_args,
    "bench": serving_run.make_parser().parse_args,
    "bench http": serving_matrix.make_preset_parser("http").parse_args,
    "bench_engine": bench_engine.make_parser().parse_args,
    "soak": soak.parse_args,
    "fake_server": fake_server.parse_args,
    "gpu_check": gpu_check.make_parser().parse_args,
}


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_help_prints_and_exits_0(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        PARSERS[name](["--help"])
    assert exit_.value.code == 0
    assert "usage:" in capsys.readouterr().out
