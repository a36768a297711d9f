"""The drafter on its own process (``spec_decode/pipeline.py``): same tokens, clean exits.

Drafts change speed, never tokens: with the drafter in a child process, greedy and seeded
outputs are the in-process drafter's token for token, and so are the proposals (the
prefetched ones included) and the q each sampled draft was drawn from. The child never
outlives its engine: closed, garbage-collected, killed, or orphaned by its parent's death.
"""
from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from minillm import SamplingParams
from minillm.config import EngineConfig, SpeculativeConfig
from minillm.engine import build_engine
from minillm.spec_decode.pipeline import DraftProcess

from test_spec_engine import TINY, TINY_WEIGHTS, assert_all_free, tiny_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(autouse=True)
def _one_thread():
    """The tiny model runs fastest on one thread (see tests/test_spec_engine.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def engine_for(spec, **kwargs):
    # a dict, as LLM(speculative={...}) passes it
    opts = dict(engine="paged", device="cpu", dtype="float32", max_model_len=128, block_size=4, max_num_seqs=4)
    config = EngineConfig.from_kwargs(**(opts | kwargs), speculative=spec)
    return build_engine(config, weights=TINY_WEIGHTS, tokenizer=None, model_config=TINY)


def record_proposals(engine):
    """Every proposal the engine verifies: (request id, position) -> (drafts, q)."""
    seen = {}
    propose = engine.speculator.propose

    def recording(out):
        n = propose(out)
        for row in out.rows:
            if row.max_drafts:
                seen[row.request.request_id, row.request.num_tokens] = (list(row.spec_token_ids), row.draft_probs)
        return n

    engine.speculator.propose = recording
    return seen


def run(engine, prompts, params):
    params = params if isinstance(params, list) else [params] * len(prompts)
    return [o.token_ids for o in engine.run([engine.make_request(p, sp) for p, sp in zip(prompts, params)])]


def state(pid: int) -> str | None:
    """The process's state letter (R, S, Z for a zombie, ...), None once it is reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def gone(pid: int, within_s: float = 5.0) -> bool:
    """Our child has exited and we reaped it: no process, no zombie left behind."""
    deadline = time.monotonic() + within_s
    while state(pid) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    return state(pid) is None


def exited(pid: int, within_s: float = 5.0) -> bool:
    """Someone else's child has exited (reaping it is its new parent's business)."""
    deadline = time.monotonic() + within_s
    while state(pid) not in (None, "Z") and time.monotonic() < deadline:
        time.sleep(0.05)
    return state(pid) in (None, "Z")


SPECS = {
    "ngram": dict(method="ngram", num_speculative_tokens=3, disable_by_batch_size=None),
    "self-draft": dict(method="model", draft_layers=[0, 2], num_speculative_tokens=3, disable_by_batch_size=None),
}


def test_bad_draft_process_value():
    with pytest.raises(ValueError, match="draft_process must be True or False"):
        SpeculativeConfig(method="ngram", draft_process="yes")
    with pytest.raises(ValueError, match="draft_process must be True or False"):
        EngineConfig.from_kwargs(engine="paged", speculative={"method": "ngram", "draft_process": 1})
    with pytest.raises(ValueError, match="runs an NgramDrafter or a ModelDrafter"):
        DraftProcess(object(), 4)


@pytest.mark.parametrize("name", SPECS)
def test_same_tokens_and_proposals_as_in_process(name):
    """Batch 1 and a batch of four, greedy then seeded sampling: the same tokens, the same drafts
    at every position, the same q; then the child fails (a malformed message) and the error is
    a RuntimeError here, with the child gone."""
    inproc, piped = engine_for(SPECS[name]), engine_for(SPECS[name] | dict(draft_process=True))
    drafter = piped.speculator.drafter
    assert isinstance(drafter, DraftProcess) and drafter.process.is_alive()
    want, got = record_proposals(inproc), record_proposals(piped)
    for prompts in (tiny_prompts()[:1], tiny_prompts()):
        assert run(piped, prompts, GREEDY) == run(inproc, prompts, GREEDY), f"{name}, batch {len(prompts)}"
    sampled = [SamplingParams(temperature=0.8, top_k=20, max_tokens=20, ignore_eos=True, seed=s) for s in range(4)]
    assert run(piped, tiny_prompts(), sampled) == run(inproc, tiny_prompts(), sampled), f"{name}: seeded sampling"
    assert want.keys() == got.keys() and len(want) > 20
    for key, (drafts, q) in want.items():
        assert got[key][0] == drafts, f"{name}: the proposal at {key} differs"
        if q is None:
            assert got[key][1] is None, "a deterministic drafter has no q"
        else:  # greedy rows: the one-hot rebuilt here; sampled rows: what the child drew from
            torch.testing.assert_close(got[key][1], q, rtol=1e-5, atol=1e-7)
    s = drafter.stats
    assert s["rows"] > 0 and s["tokens"] == piped.spec_stats.num_drafts == inproc.spec_stats.num_drafts
    if name == "self-draft":
        assert drafter.num_forwards > 0 and s["prefetch_forwards"] > 0
    assert_all_free(piped)
    pid = drafter.process.pid
    with pytest.raises(RuntimeError, match="the draft process failed"):
        drafter._send(("propose", -1, [("not a row",)], []))
        drafter._receive("drafts", 10)
    assert gone(pid), "a failed child must be stopped and reaped"
    with pytest.raises(RuntimeError, match="build a new engine"):
        run(piped, tiny_prompts()[:1], GREEDY)


def test_a_draft_that_agrees_is_served_from_the_prefetch():
    """A draft made of every layer IS the target: each step accepts every draft and the bonus
    token is the draft's next guess, so (given time between steps) the child has the next
    proposal ready. Acceptance stays 1.0: its chains and K/V roll forward correctly."""
    spec = dict(method="model", draft_layers=[0, 1, 2], num_speculative_tokens=3, disable_by_batch_size=None)
    engine = engine_for(spec | dict(draft_process=True))
    reference = run(engine_for(None), tiny_prompts()[:2], GREEDY)
    reqs = [engine.make_request(p, GREEDY) for p in tiny_prompts()[:2]]
    for r in reqs:
        engine.scheduler.add(r)
    while engine.has_unfinished():
        engine.step()
        time.sleep(0.1)  # time for the child to prefetch, as a slow target forward would give it
    assert [engine.output(r).token_ids for r in reqs] == reference
    assert engine.spec_stats.acceptance_rate == 1.0
    s = engine.speculator.drafter.stats
    assert s["rows_prefetched"] >= s["rows"] - 2 * len(reqs), f"the prefetch should serve almost every row: {s}"
    pid = engine.speculator.drafter.process.pid
    engine.speculator.drafter.close()
    assert gone(pid)
    engine.speculator.drafter.close()  # idempotent


def test_child_gone_when_the_engine_is_deleted():
    engine = engine_for(SPECS["self-draft"] | dict(draft_process=True))
    run(engine, tiny_prompts()[:2], GREEDY)
    pid = engine.speculator.drafter.process.pid
    del engine
    gc.collect()
    assert gone(pid), "the finalizer must stop the child when the engine is collected"


def test_killed_child_raises_within_seconds():
    engine = engine_for(SPECS["ngram"] | dict(draft_process=True))
    reqs = [engine.add_request(p, GREEDY) for p in tiny_prompts()]
    engine.step()
    engine.step()
    assert engine.spec_stats.num_drafts >= 0 and engine.speculator.drafter.stats["steps"] > 0
    pid = engine.speculator.drafter.process.pid
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"draft process \d+ died"):
        for _ in range(5):
            engine.step()
    assert time.monotonic() - start < 5
    assert gone(pid)
    for r in reqs:
        engine.abort(r)


def test_child_exits_when_its_parent_dies():
    """SIGKILL leaves no time for a finalizer: the child notices its parent is gone and exits."""
    code = textwrap.dedent("""
        import sys, time
        from minillm.spec_decode.drafters import NgramDrafter
        from minillm.spec_decode.pipeline import DraftProcess
        if __name__ == "__main__":
            d = DraftProcess(NgramDrafter(), 4)
            print(d.process.pid, flush=True)
            time.sleep(60)
    """)
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        child = int(parent.stdout.readline())
        parent.kill()
        parent.wait()
        assert exited(child), "the draft process outlived its parent"
    finally:
        parent.kill()


def test_a_request_that_pauses_drafting():
    """A request drafts, then does not (the off switch: three requests run), then drafts again
    with a dozen new tokens at once: the child keeps only the K/V before the first token where
    its chain and the real tokens part, and proposes what the in-process drafter proposes."""
    spec = SPECS["self-draft"] | dict(disable_by_batch_size=2)
    long, short = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), \
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs, proposals = [], []
    for engine in (engine_for(spec), engine_for(spec | dict(draft_process=True))):
        proposals.append(record_proposals(engine))
        first = engine.add_request(tiny_prompts()[0], long)
        for _ in range(4):
            engine.step()
            time.sleep(0.05)  # time to prefetch a chain that the pause will leave behind
        others = [engine.add_request(p, short) for p in tiny_prompts()[1:3]]
        while engine.has_unfinished():
            engine.step()
        outputs.append([engine.output(r).token_ids for r in [first, *others]])
        assert_all_free(engine)
    assert outputs[0] == outputs[1]
    paused = [n for rid, n in proposals[0] if rid == first.request_id]
    assert max(b - a for a, b in zip(paused, paused[1:])) > 8, "the test needs a pause in drafting"
    assert proposals[0].keys() == proposals[1].keys()
    for key, (drafts, q) in proposals[0].items():
        assert proposals[1][key][0] == drafts, f"the proposal at {key} differs"


def test_bench_table_and_verdict_from_the_numbers():
    from minillm.bench import draft_pipeline as bench

    def row(drafter, batch, place, tps, draft_ms, ratio=None, spread=0.0, prefetched=None):
        r = dict(drafter=drafter, batch=batch, place=place, tokens_per_s=tps, step_ms=50.0, draft_ms=draft_ms,
                 tpot_ms=20.0, acceptance=0.9, steps=10, same_tokens=True, prefetched_rows=prefetched,
                 prefetched_tokens=prefetched)
        if ratio is not None:
            r.update(ratio=ratio, ratio_min=ratio - spread, ratio_max=ratio + spread)
        return r

    rows = [row("ngram", 1, "in", 50, 0.1), row("ngram", 1, "own", 50, 0.6, 1.00, 0.05, 0.4),
            row("self-draft", 1, "in", 10, 40.0), row("self-draft", 1, "own", 13, 30.0, 1.3, 0.1, 0.7),
            row("self-draft", 8, "in", 30, 60.0), row("self-draft", 8, "own", 24, 70.0, 0.8, 0.05, 0.0)]
    text = bench.verdict(rows)
    assert "pays at self-draft batch 1 (x1.30)" in text and "loses at self-draft batch 8 (x0.80)" in text
    assert "noise (+-2% and the rounds' spread) at ngram batch 1" in text
    table = bench.format_table(rows)
    assert len(table.splitlines()) == 2 + len(rows) and "70%" in table
    with pytest.raises(SystemExit) as exc:
        bench.main(["--help"])
    assert exc.value.code == 0
