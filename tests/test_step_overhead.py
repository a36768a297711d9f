"""The engine-overhead benchmark: the real step around a forward that costs nothing."""
from __future__ import annotations

from minillm.bench import step_overhead


def test_a_step_is_measured_whole_and_by_phase():
    row = step_overhead.measure(8, sampled=True, context=8, steps=6, vocab_size=64)
    assert row["steps"] == 6, "one pure decode step per token after the prefill"
    phases = [row[f"{p}_us"] for p in step_overhead.PHASES]
    assert all(t > 0 for t in phases) and sum(phases) <= row["step_us"]


def test_the_table_names_the_targets(capsys):
    rows = step_overhead.run([1, 8], rounds=1, steps=3, context=4, vocab_size=64)
    text = step_overhead.format_table(rows)
    assert "<= 500 µs" in text and len(rows) == 4
    assert "target" not in step_overhead.format_table(rows, targets=False)
