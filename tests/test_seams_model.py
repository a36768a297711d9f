"""Chapter 0's seams: a learner's norm, RoPE and sampler serve the model in the real engine.

With the reference answers plugged in, the engine's tokens (greedy and seeded sampling) and
schedule are the library's, on the torch and cpu attention backends; the plugged functions
really run (counted); a wrong one changes the output; the cpu backend's fused layer ops, a
compiled step and CUDA-graph replay step aside while a seam of the forward is plugged, and
come back once it is unplugged. Fast checks on the tiny random Llama of test_spec_engine.py.
"""
from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from minillm import SamplingParams, seams
from minillm import model as model_mod
from test_spec_engine import TINY, tiny_engine, tiny_prompts

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import solutions.ch00_the_model as s00  # noqa: E402

MAX = 10
GREEDY = [SamplingParams(temperature=0.0, max_tokens=MAX, ignore_eos=True)] * 4
# Seeded sampling, each row under other parameters (a greedy row in the batch too).
SAMPLED = [SamplingParams(temperature=0.9, top_k=20, max_tokens=MAX, ignore_eos=True, seed=7),
           SamplingParams(temperature=1.0, top_p=0.8, max_tokens=MAX, ignore_eos=True, seed=11),
           SamplingParams(temperature=0.0, max_tokens=MAX, ignore_eos=True),
           SamplingParams(temperature=0.7, top_k=30, top_p=0.9, max_tokens=MAX, ignore_eos=True, seed=3)]
# Seeded sampling with no top-k, no top-p: every token of the vocabulary is a legal draw.
UNFILTERED = [SamplingParams(temperature=1.0, max_tokens=MAX, ignore_eos=True, seed=s) for s in (7, 11, 3, 5)]
SOLUTIONS = dict(rms_norm=s00.rms_norm, apply_rope=s00.apply_rope, sample_next_token=s00.sample_next_token)


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """These tests time nothing: one thread keeps them quick on a shared machine."""


def run(engine, params, prompts=None):
    prompts = tiny_prompts(len(params)) if prompts is None else prompts
    return [o.token_ids for o in engine.run([engine.make_request(p, sp) for p, sp in zip(prompts, params)])]


def schedule_of(engine):
    return [(tuple(s.request_ids), tuple(s.num_new_tokens)) for s in engine.step_records]


def counted(fns: dict, calls: Counter) -> dict:
    def wrap(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call
    return {name: wrap(name, fn) for name, fn in fns.items()}


def count_fused(engine) -> Counter:
    """Count the forwards that take the cpu backend's fused layer ops (``Llama._cpu_layers``)."""
    m, calls = engine.runner.model, Counter()
    fused = m._cpu_layers

    def call(*args, **kwargs):
        calls["fused"] += 1
        return fused(*args, **kwargs)

    m._cpu_layers = call
    return calls


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def norm_without_rsqrt(x, weight, eps):  # wrong: forgets to divide by the root mean square
    return (x.float().to(x.dtype) * weight).to(x.dtype)


def rope_sin_flipped(x, cos, sin):  # wrong: rotates the other way
    return (x * cos[:, None, :] - rotate_half(x) * sin[:, None, :]).to(x.dtype)


def always_token_0(logits, temperature, top_k=-1, top_p=1.0, generator=None):  # wrong
    return 0


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_reference_answers_serve_the_library_tokens(backend, params):
    ref_engine = tiny_engine(attention_backend=backend)
    ref = run(ref_engine, params)
    eng = tiny_engine(attention_backend=backend)
    fused = count_fused(eng)
    calls = Counter()
    with seams.plug(**counted(SOLUTIONS, calls)):
        got = run(eng, params)
    assert got == ref
    assert schedule_of(eng) == schedule_of(ref_engine)
    # Every forward ran the plain layer loop: each norm and each layer's RoPE through the seam,
    # and every generated token came from the plugged sampler.
    steps = len(eng.step_records)
    assert calls["rms_norm"] == steps * (2 * TINY.num_layers + 1)
    assert calls["apply_rope"] == steps * TINY.num_layers
    assert calls["sample_next_token"] == sum(len(t) for t in got)
    assert fused["fused"] == 0


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("seam,wrong", [("rms_norm", norm_without_rsqrt), ("apply_rope", rope_sin_flipped),
                                        ("sample_next_token", always_token_0)])
def test_a_wrong_piece_changes_the_output(backend, seam, wrong):
    # Token 0 is a legal draw only for a row with neither a filter nor greedy decoding: the
    # engine checks each plugged token against its row's rule, so those rows let it through.
    params = UNFILTERED if seam == "sample_next_token" else SAMPLED
    ref = run(tiny_engine(attention_backend=backend), params)
    eng = tiny_engine(attention_backend=backend)
    with seams.plug(**{seam: wrong}):
        got = run(eng, params)
    assert got != ref
    if seam == "sample_next_token":
        assert all(t == 0 for toks in got for t in toks)


@pytest.mark.parametrize("params,rule", [(SAMPLED, "top-k, then top-p filter"), (GREEDY, "temperature 0 is greedy")],
                         ids=["filtered", "greedy"])
def test_a_sampler_token_outside_its_rows_rule_stops_the_engine(params, rule):
    eng = tiny_engine()
    with seams.plug(sample_next_token=always_token_0):
        with pytest.raises(seams.SeamContractError, match=rule):
            run(eng, params)


def test_the_fused_cpu_path_steps_aside_while_plugged_and_comes_back():
    eng = tiny_engine(attention_backend="cpu")
    fused = count_fused(eng)
    ref = run(eng, GREEDY)
    assert fused["fused"] == len(eng.step_records) > 0, "nothing plugged: the cpu backend's fused layer ops run"
    for seam in ("rms_norm", "apply_rope"):
        fused.clear()
        with seams.plug(**{seam: SOLUTIONS[seam]}):
            assert model_mod.forward_seam_plugged()
            assert run(eng, GREEDY) == ref
        assert fused["fused"] == 0, f"{seam} plugged: the plain layer loop must run"
        assert not model_mod.forward_seam_plugged()
    fused.clear()
    assert run(eng, GREEDY) == ref
    assert fused["fused"] > 0, "unplugged: the fused layer ops are back"


def store_kv_torch(k, v, k_cache, v_cache, slot_mapping):
    """The K/V store in plain torch (chapter 3's seam; its exercise asks for a Triton kernel)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep].to(v_cache.dtype)


def test_a_plugged_kv_store_makes_the_fused_path_step_aside(monkeypatch):
    from minillm import attention

    # A plugged store on CPU tensors asks for Triton's interpreter (a Triton kernel runs only
    # there); this one is plain torch, so it runs whether or not the interpreter is on.
    monkeypatch.setattr(attention, "triton_interprets", lambda: True)
    eng = tiny_engine(attention_backend="cpu")
    ref = run(eng, GREEDY)
    fused = count_fused(eng)
    calls = Counter()
    with seams.plug(**counted({"store_kv_triton": store_kv_torch}, calls)):
        assert model_mod.forward_seam_plugged()
        assert run(eng, GREEDY) == ref
    assert fused["fused"] == 0 and calls["store_kv_triton"] > 0


def test_a_compiled_step_runs_the_eager_forward_while_a_seam_of_the_forward_is_plugged():
    from minillm.compiled import CompiledForward
    from minillm.model_runner import build_batch
    from minillm.request import Request
    from minillm.scheduler import ScheduledRequest

    eng = tiny_engine(attention_backend="torch")
    runner = eng.runner
    compiled = CompiledForward(runner.model)

    def no_graph(*args):
        raise AssertionError("the compiled graph ran while a seam of the forward was plugged")

    compiled._fn = no_graph
    req = Request("r", tiny_prompts(1)[0], SamplingParams())
    req.block_ids = list(range(4))
    b = build_batch([ScheduledRequest(req, len(req.prompt_token_ids))], runner.block_size, runner.device)
    eager = runner.model(b.input_ids, b.positions, b.meta, runner.kv_caches)
    calls = Counter()
    with seams.plug(**counted({"rms_norm": s00.rms_norm}, calls)), torch.inference_mode():
        got = compiled(b.input_ids, b.positions, b.meta, runner.kv_caches)
    assert calls["rms_norm"] == 2 * TINY.num_layers + 1
    torch.testing.assert_close(got, eager, rtol=0, atol=0)
    with pytest.raises(AssertionError, match="compiled graph ran"):
        compiled(b.input_ids, b.positions, b.meta, runner.kv_caches)  # unplugged: the graph's turn


def test_cuda_graph_replay_steps_aside_while_a_seam_of_the_forward_is_plugged():
    eng = tiny_engine(attention_backend="torch")
    ref = run(eng, GREEDY)

    class Graphs:  # stands in for DecodeGraphs (CUDA): every decode step would replay
        replays = 0

        def can_replay(self, out, b):
            return all(r.num_new_tokens == 1 for r in out.rows)

        def replay(self, b):
            Graphs.replays += 1
            raise AssertionError("replayed a captured graph while a seam of the forward was plugged")

    eng.runner.graphs = Graphs()
    with seams.plug(apply_rope=s00.apply_rope):
        assert run(eng, GREEDY) == ref
    assert Graphs.replays == 0
    # And no graph is captured while one is plugged (it would replay the learner's kernels later).
    with seams.plug(rms_norm=s00.rms_norm):
        eng.runner.graphs = None
        eng.runner.capture_cuda_graphs(4, 128)  # would fail on a CPU if it tried to capture
        assert eng.runner.graphs is None


def test_sampler_seam_in_a_speculative_engine_keeps_seeded_tokens():
    # Rows without drafts take the plain sampler (the seam); drafts are verified by the
    # speculator's own rule, which the seam does not replace.
    spec = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, disable_by_batch_size=None)
    ref = run(tiny_engine(spec), SAMPLED)
    eng = tiny_engine(spec)
    calls = Counter()
    with seams.plug(**counted(SOLUTIONS, calls)):
        assert run(eng, SAMPLED) == ref
    assert calls["sample_next_token"] > 0 and calls["rms_norm"] > 0


def test_a_sampler_returning_no_token_id_is_a_clear_error():
    eng = tiny_engine()
    with seams.plug(sample_next_token=lambda logits, *a, **k: logits.shape[-1]):
        with pytest.raises(ValueError, match="sample_next_token returned"):
            run(eng, GREEDY)
