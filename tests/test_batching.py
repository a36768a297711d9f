"""Static and continuous batching on the real model (fp32, CPU).

The strongest check: whatever the batch size, every request's greedy tokens equal the
tokens of that request run alone. Then what the step records must say, the bad inputs,
and the transformers baselines on the same requests.
"""
from __future__ import annotations

import pytest

from minillm import EngineConfig, SamplingParams
from minillm.engine import LLM, build_engine
from minillm.bench.summary import slot_utilization

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "Three colours of the rainbow are",
    "The best way to learn to cook is",
]
MAX_TOKENS = [10, 4, 16, 3, 7]  # different lengths: requests finish and leave at different steps
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def model_files():
    from minillm import loader

    return loader.load_weights(), loader.load_tokenizer()


def make_engine(model_files, engine: str, max_num_seqs: int, **kw):
    weights, tok = model_files
    cfg = EngineConfig(engine=engine, max_num_seqs=max_num_seqs, max_model_len=MAX_MODEL_LEN, device="cpu",
                       dtype="float32", **kw)
    return build_engine(cfg, weights=weights, tokenizer=tok)


def generate(eng, prompts=PROMPTS, max_tokens=MAX_TOKENS):
    reqs = [eng.make_request(p, SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True))
            for p, m in zip(prompts, max_tokens)]
    return [o.token_ids for o in eng.run(reqs)]


@pytest.fixture(scope="module")
def alone(model_files):
    """Each request on its own: the simple engine, one request at a time."""
    eng = make_engine(model_files, "simple", 1)
    return [generate(eng, [p], [m])[0] for p, m in zip(PROMPTS, MAX_TOKENS)]


@pytest.fixture(scope="module")
def batched(model_files):
    """(engine, max_num_seqs) -> (engine after the run, tokens): each configuration runs once."""
    cache = {}

    def get(engine, max_num_seqs):
        if (engine, max_num_seqs) not in cache:
            eng = make_engine(model_files, engine, max_num_seqs)
            cache[engine, max_num_seqs] = eng, generate(eng)
        return cache[engine, max_num_seqs]

    return get


@pytest.mark.parametrize("max_num_seqs", [1, 3, 8])
@pytest.mark.parametrize("engine", ["static", "continuous"])
def test_batched_greedy_equals_alone(batched, alone, engine, max_num_seqs):
    eng, got = batched(engine, max_num_seqs)
    for i, (g, a) in enumerate(zip(got, alone)):
        assert g == a, (f"{engine} engine, max_num_seqs={max_num_seqs}: request {i} ({PROMPTS[i]!r}) gave {g}, "
                        f"alone it gives {a}")
    assert [len(g) for g in got] == MAX_TOKENS
    steps = eng.step_records
    assert max(s.num_rows for s in steps) <= max_num_seqs
    assert all(s.kv_used_bytes <= s.kv_reserved_bytes for s in steps)


def test_step_records_static_vs_continuous(batched):
    static, _ = batched("static", 3)
    cont, _ = batched("continuous", 3)
    s_steps, c_steps = static.step_records, cont.step_records
    # static: group 1 = requests 0-2 (16 steps: its longest wants 16 tokens), group 2 = 3-4 (7 steps)
    assert len(s_steps) == 16 + 7
    assert s_steps[0].padded_tokens > 0  # prompts of different lengths padded to the longest
    assert any(s.held_ids for s in s_steps)  # finished members keep their slot
    assert all(s.kv_reserved_bytes == 3 * MAX_MODEL_LEN * static.kv_bytes_per_token for s in s_steps[:15])
    assert len(c_steps) < len(s_steps)
    assert slot_utilization(c_steps) > slot_utilization(s_steps)
    assert not any(s.held_ids for s in c_steps)


# -- bad input ---------------------------------------------------------------------------------


def test_unknown_engine_lists_valid_names():
    with pytest.raises(ValueError, match="valid engines: simple, static, continuous"):
        LLM(engine="turbo")


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
])
def test_bad_batch_settings(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(engine="continuous", **kwargs)


@pytest.mark.parametrize("engine", ["static", "continuous"])
def test_prompt_that_can_never_fit_is_rejected_without_stalling(model_files, engine):
    eng = make_engine(model_files, engine, 2, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    first = eng.add_request("Hello", params)
    with pytest.raises(ValueError, match="max_num_batched_tokens is 16"):
        eng.add_request(list(range(100, 140)), params)  # 40 prompt tokens > budget 16
    with pytest.raises(ValueError, match="max_model_len"):
        eng.add_request(list(range(100, 100 + MAX_MODEL_LEN)), params)
    second = eng.add_request("World", params)
    for _ in range(20):
        if not eng.has_unfinished():
            break
        eng.step()
    assert first.is_finished and second.is_finished and second.num_output_tokens == 3


# -- the transformers baselines on the same requests -----------------------------------------------


def test_hf_baselines_match_on_the_same_requests(model_files, alone):
    from minillm import loader
    from minillm.bench import hf_baselines
    from minillm.bench.workload import Workload, WorkloadRequest

    _, tok = model_files
    want = [6, 2, 8]  # greedy: a shorter run is a prefix of the longer one run alone
    reqs = [WorkloadRequest(str(i), list(tok(p).input_ids), m, 0.0) for i, (p, m) in enumerate(zip(PROMPTS, want))]
    wl = Workload("custom", 0, "offline", None, reqs)
    expected = [a[:m] for a, m in zip(alone, want)]
    hf = loader.load_hf_model()
    gen = hf_baselines.run_hf_generate(hf, wl, 2, pad_token_id=2)
    assert gen.output_token_ids == expected
    assert len(gen.steps) == 6 + 8  # group (0, 1) runs 6 steps, group (2,) runs 8
    assert 0 < slot_utilization(gen.steps) < 1
    cb = hf_baselines.run_hf_continuous(hf, wl, 2, 256, MAX_MODEL_LEN, pad_token_id=2)
    assert cb.output_token_ids == expected
    assert all(m.ttft is not None and m.ttft >= 0 for m in cb.metrics)
    assert len(cb.steps) >= 8
