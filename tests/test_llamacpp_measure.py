"""python -m minillm.bench.llamacpp_measure: its report, its verdicts, its usage errors.

The measurement itself needs llama.cpp (make peer-llamacpp) and minutes of both engines; these
tests feed ``report`` made-up runs and check what it concludes from them.
"""
from __future__ import annotations

import pytest

from minillm.bench import llamacpp_measure as lm


def _runs(mine, theirs, peer="llama.cpp 8 slots", tokens=((1, 2, 3),)):
    def run(x):
        return {"tok_s": x, "other_cores": 0.01, "tokens": [list(t) for t in tokens]}

    return {"minillm q4 float32": [run(x) for x in mine], "minillm q4 bfloat16": [run(x) for x in mine],
            peer: [run(x) for x in theirs]}


def test_the_report_compares_round_by_round_and_judges_the_median():
    met = lm.report({"skewed": {"requests": 8, "output_tokens": 975, "runs": _runs([150, 160, 140], [100, 100, 100])}})
    assert "1.50x, 1.60x, 1.40x; median 1.50x  target 1.5x: met" in met
    missed = lm.report({"skewed": {"requests": 8, "output_tokens": 975, "runs": _runs([150, 140, 140], [100, 100, 100])}})
    assert "median 1.40x  target 1.5x: NOT met" in missed
    batch1 = lm.report({"batch1": {"requests": 4, "output_tokens": 256,
                                   "runs": _runs([80, 90], [100, 100], peer="llama.cpp batch 1")}})
    assert "llama.cpp batch 1: 0.80x, 0.90x; median 0.85x  target 0.8x: met" in batch1
    uniform = lm.report({"uniform": {"requests": 8, "output_tokens": 1024, "runs": _runs([300], [100])}})
    assert "3.00x; median 3.00x" in uniform and "target" not in uniform  # no target for this one


def test_the_report_says_when_tokens_differ():
    runs = _runs([150, 150], [100, 100])
    runs["llama.cpp 8 slots"][1]["tokens"] = [[1, 2, 4]]
    text = lm.report({"skewed": {"requests": 1, "output_tokens": 3, "runs": runs}})
    assert "every engine gave the same tokens in every round: False" in text


def test_timed_run_returns_the_result_and_a_share_of_other_cores():
    result, other = lm.timed_run(lambda: sum(range(200_000)))
    assert result == sum(range(200_000))
    assert other is None or other >= 0.0


@pytest.mark.parametrize("argv,message", [(["--workloads", "chat"], "choose from batch1, skewed, uniform"),
                                          (["--rounds", "0"], "at least 1")])
def test_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        lm.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
