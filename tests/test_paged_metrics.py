"""The KV-memory numbers of the benchmark: kv_waste_fraction, max_concurrency, preemptions.

Definitions (minillm/bench/summary.py):

* kv_waste_fraction: per step, (reserved - used) / reserved of the KV memory held by the
  requests holding KV space after the step; averaged over steps weighted by duration.
* max_concurrency: the peak, over steps, of the requests running after the step.
* preemptions: the sum of every request's preemption count.

Most tests drive the real schedulers without a model (a step per ``schedule()``, a fake
token per sampling row), so they run in milliseconds; one slow test runs the CLI.
"""
from __future__ import annotations

import json

import pytest

from minillm.bench import compare
from minillm.config import EngineConfig, ModelConfig
from minillm.scheduler import build_scheduler
from minillm.metrics import StepRecord, record_step
from minillm.bench.summary import RunResult, format_table, kv_waste_fraction, max_concurrency, summarize
from minillm.request import Request, RequestMetrics
from minillm.resolve import resolve
from minillm.bench.workload import make_workload

PER_TOKEN = ModelConfig().kv_bytes_per_token(4)


def step(k, duration, reserved, used, running=1):
    return StepRecord(k, float(k), float(k) + duration, [], [1] * running, running, running, 0,
                      kv_reserved_bytes=reserved, kv_used_bytes=used)


def replay(workload, engine, max_num_seqs, **options):
    """The real scheduler of ``engine`` on ``workload``, no model: (steps, scheduler, requests)."""
    L = workload.default_max_model_len()
    cfg = EngineConfig(engine=engine, max_num_seqs=max_num_seqs, max_model_len=L, dummy_weights=True, **options)
    rc = resolve(cfg, ModelConfig())
    sched, block_size = build_scheduler(cfg, rc, ModelConfig().eos_token_id), rc.block_size
    reqs = [Request(w.request_id, list(w.prompt_token_ids), w.sampling_params(), arrival_time=0.0) for w in workload]
    for r in reqs:
        sched.add(r)
    steps = []
    while sched.has_unfinished():
        k = len(steps)
        out = sched.schedule()
        assert out.rows, "the scheduler stalled"
        sampled = {i: [7] for i, row in enumerate(out.rows) if row.samples}
        sched.update(out, sampled, now=k + 1.0)
        steps.append(record_step(k, float(k), k + 1.0, out, len(sampled), sched, block_size, PER_TOKEN))
    return steps, sched, reqs


@pytest.fixture(scope="module")
def chat():
    # The benchmark's mix (log-normal lengths), token ids without a tokenizer.
    return make_workload("chat", 32, seed=0)


# ------------------------------------------------------------------ definitions


def test_kv_waste_fraction_weights_steps_by_duration():
    steps = [step(0, 1.0, 100, 50), step(1, 3.0, 100, 100), step(2, 5.0, 0, 0)]
    # (1 s x 0.5 + 3 s x 0.0) / 4 s; the step that reserves nothing is left out.
    assert kv_waste_fraction(steps) == pytest.approx(0.125), \
        "kv_waste_fraction must be the duration-weighted mean of (reserved - used) / reserved over steps"


def test_kv_waste_fraction_edge_cases():
    assert kv_waste_fraction([]) is None, "no steps: no waste to report (None)"
    assert kv_waste_fraction([step(0, 1.0, 0, 0)]) is None, "nothing ever reserved: None, not 0 or a division error"
    # Steps without durations (e.g. records with start == end) count once each.
    assert kv_waste_fraction([step(0, 0.0, 100, 0), step(1, 0.0, 100, 100)]) == pytest.approx(0.5)


def test_max_concurrency_is_the_peak_of_running_requests():
    steps = [step(0, 1.0, 1, 1, running=3), step(1, 1.0, 1, 1, running=7), step(2, 1.0, 1, 1, running=2)]
    assert max_concurrency(steps) == 7
    assert max_concurrency([]) == 0


def test_summarize_reports_the_paged_fields():
    metrics = [RequestMetrics(0.0, finish_time=1.0, num_preemptions=n) for n in (0, 2, 1)]
    res = RunResult("paged", metrics, [[1], [2], [3]], [step(0, 1.0, 100, 75, running=3)], 0.0, 1.0, 3, 1000)
    s = summarize(res)
    assert s["kv_waste_fraction"] == pytest.approx(0.25)
    assert s["max_concurrency"] == 3
    assert s["preemptions"] == 3, "preemptions is the sum of the requests' counts"
    json.dumps(s)  # the JSON file must be writable
    table = format_table([s])
    assert "KV waste" in table and "0.250" in table


# ------------------------------------------------------------------ the schedulers


def test_waste_contiguous_vs_paged_same_bytes(chat):
    cont, _, _ = replay(chat, "continuous", 8)
    paged, sched, _ = replay(chat, "paged", 8, block_size=16)
    assert sched.block_manager.num_blocks * 16 == 8 * chat.default_max_model_len(), \
        "by default the paged cache has the contiguous engine's bytes"
    assert kv_waste_fraction(cont) >= 0.5, "contiguous regions of max_model_len are mostly empty on the chat mix"
    assert kv_waste_fraction(paged) <= 0.04, "blocks of 16 waste under a block per request"
    for s in paged:  # the bound behind it: each running request wastes at most block_size - 1 slots
        assert s.kv_reserved_bytes - s.kv_used_bytes <= s.num_running * 15 * PER_TOKEN


def test_paged_runs_more_requests_in_the_same_bytes(chat):
    L = chat.default_max_model_len()
    cont, _, _ = replay(chat, "continuous", 8)
    paged, _, _ = replay(chat, "paged", 32, block_size=16, num_blocks=8 * L // 16)
    assert max_concurrency(cont) == 8
    assert max_concurrency(paged) >= 2 * max_concurrency(cont)


def test_preemptions_are_counted_per_request_and_in_total(chat):
    # A cache of one max_model_len request for 8 slots: growth forces preemptions.
    L = chat.default_max_model_len()
    steps, sched, reqs = replay(chat, "paged", 8, block_size=16, num_blocks=L // 16)
    assert sched.num_preemptions > 0, "the cache was sized to force preemptions"
    res = RunResult("paged", [r.metrics for r in reqs], [r.output_token_ids for r in reqs], steps, 0.0,
                    float(len(steps)), 8, L * PER_TOKEN)
    assert summarize(res)["preemptions"] == sched.num_preemptions
    assert all(len(r.output_token_ids) == w.max_tokens for r, w in zip(reqs, chat)), "every request finished"


# ------------------------------------------------------------------ the CLI


def test_bench_parser_accepts_the_paged_options():
    args = compare.build_parser().parse_args(
        ["--engine", "continuous,paged", "--block-size", "8", "--num-blocks", "64", "--attention-backend", "torch"])
    assert (args.block_size, args.num_blocks, args.attention_backend) == (8, 64, "torch")
    assert compare.parse_engines(args.engine) == ["continuous", "paged"]
    with pytest.raises(SystemExit):
        compare.build_parser().parse_args(["--attention-backend", "cuda"])


@pytest.mark.parametrize("flags, message", [
    (["--block-size", "12"], "power of two"),
    (["--num-blocks", "0"], "num_blocks"),
])
def test_bench_rejects_bad_paged_options(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        compare.main(["--engine", "paged", "--dummy-weights", "--num-requests", "2", *flags])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_bench_cli_paged_json(tmp_path):
    """The CLI end to end on dummy weights: both engines, the new fields, the same tokens."""
    out = tmp_path / "compare.json"
    rc = compare.main(["--engine", "continuous,paged", "--dummy-weights", "--workload", "uniform",
                     "--num-requests", "4", "--workload-param", "output_len=6", "--max-num-seqs", "2",
                     "--block-size", "8", "--no-progress", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    cont, paged = data["continuous"], data["paged"]
    for s in (cont, paged):
        for key in ("kv_waste_fraction", "max_concurrency", "preemptions"):
            assert key in s, f"{s['engine']}: the JSON lacks {key}"
    from minillm import placement

    assert paged["block_size"] == 8 and paged["attention_backend"] == placement.resolve().attention_backend
    assert paged["num_blocks"] * 8 == 2 * paged["max_model_len"], "default: the contiguous engine's bytes"
    assert paged["kv_reserved_bytes"] == cont["kv_reserved_bytes"]
    assert paged["kv_waste_fraction"] < cont["kv_waste_fraction"]
    assert cont["max_concurrency"] == paged["max_concurrency"] == 2
    assert paged["preemptions"] == cont["preemptions"] == 0
    assert paged["same_tokens_as"]["fraction"] == 1.0


def test_plot_block_tables_draws_every_block():
    import matplotlib

    matplotlib.use("Agg")
    from minillm.viz import charts

    tables = {"0": [3, 0, 5], "1": [1, 4]}
    ax = charts.plot_block_tables(tables, num_blocks=8, block_size=4, num_tokens={"0": 10, "1": 5}, arrows=True)
    labels = [t.get_text() for t in ax.texts]
    for b in range(8):
        assert labels.count(str(b)) == 1 + sum(t.count(b) for t in tables.values()), \
            f"block {b}: once in the pool, once per table entry that points at it"
    assert len(ax.patches) == 8 + 5 + 5, "8 pool cells, 5 table cells, 5 filled parts (partial last blocks too)"
    import matplotlib.pyplot as plt

    plt.close("all")
