"""loadtests/wire_cost.py: every format round-trips a step message, and
`bench_engine --wire` prints a row per format and message size."""
from __future__ import annotations

import json

from loadtests import bench_engine
from loadtests.wire_cost import measure


def test_every_format_round_trips_and_is_timed():
    rows = measure(num_deltas=5, num_tokens=3, num_samples=2, number=1)
    assert set(rows) == {"lists", "structs", "msgspec"}
    assert all(row["bytes"] > 0 and row["encode_us"] > 0 and row["decode_us"] > 0
               for row in rows.values())


def test_wire_mode_prints_one_row_per_format_and_size(capsys, tmp_path):
    result = bench_engine.main(["--wire", "--num-deltas", "4", "--tokens", "1", "8", "--samples", "2",
                                "--result-dir", str(tmp_path)])
    lines = capsys.readouterr().out.splitlines()
    table = [line for line in lines if line.startswith("| 4 x ")]
    assert len(table) == 2 * 3 and lines[0].startswith("| message, format")
    assert table[0].startswith("| 4 x 1 token, lists") and table[-1].startswith("| 4 x 8 tokens, msgspec")
    assert set(json.loads((tmp_path / "bench_engine_wire.json").read_text())) == set(result) == {"4 x 1", "4 x 8"}
