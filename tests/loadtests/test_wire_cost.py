"""loadtests/wire_cost.py: every format round-trips a step message, and the table
has a row per format and message size."""
from __future__ import annotations

from loadtests.wire_cost import main, measure


def test_every_format_round_trips_and_is_timed():
    rows = measure(num_deltas=5, num_tokens=3, num_samples=2, number=1)
    assert set(rows) == {"lists", "structs", "msgspec"}
    assert all(row["bytes"] > 0 and row["encode_us"] > 0 and row["decode_us"] > 0
               for row in rows.values())


def test_main_prints_one_row_per_format_and_size(capsys):
    main(["--num-deltas", "4", "--tokens", "1", "8", "--samples", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 + 2 * 3
    assert lines[1].startswith("4 x 1 token ") and lines[-1].startswith("4 x 8 tokens")
