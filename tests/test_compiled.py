"""LLM(compile=True): the step's forward as one compiled graph (minillm/compiled.py).

A compiled step is the eager step with its elementwise ops fused, so: logits as eager's
up to float rounding, one graph for every number of tokens (no recompile when a batch
shrinks to one row), and greedy tokens of a request the same alone as in any batch, in
both engines, with chunked prefill and with a paged cache of small blocks.
"""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from minillm import SamplingParams
from minillm.compiled import check_compile
from minillm.config import EngineConfig, ModelConfig
from minillm.engine import LLM, build_engine
from minillm.model_runner import prompt_logits
from minillm.resolve import resolve

TINY = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, max_position_embeddings=256)


def _prompts(n=6):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 128, (3 + 9 * i,), generator=g).tolist() for i in range(n)]


def _engine(compile, **kw):
    cfg = EngineConfig(max_num_seqs=kw.pop("max_num_seqs", 4), max_model_len=96, compile=compile, **kw)
    return build_engine(cfg, model_config=TINY, tokenizer=None)


def _greedy(eng, prompts, together=True):
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    if together:
        return [o.token_ids for o in eng.run([eng.make_request(p, sp) for p in prompts])]
    return [eng.run([eng.make_request(p, sp)])[0].token_ids for p in prompts]


@pytest.mark.parametrize("options", [
    {"engine": "continuous"},
    {"engine": "paged", "block_size": 4},
    {"engine": "paged", "block_size": 8, "enable_chunked_prefill": True, "max_num_batched_tokens": 16},
], ids=["continuous", "paged-block4", "paged-chunked16"])
def test_a_request_decodes_the_same_tokens_alone_as_in_a_batch(options):
    prompts = _prompts()
    torch._dynamo.reset()  # another test's graph for the same model class would be reused: count from nothing
    graphs = counters["stats"]["unique_graphs"]
    eng = _engine(True, **options)
    together = _greedy(eng, prompts)
    alone = _greedy(eng, prompts, together=False)
    assert together == alone
    assert all(len(t) == 20 for t in together)
    # One graph served prefills, chunks, batches of 4 and single rows: it was compiled, once.
    assert counters["stats"]["unique_graphs"] - graphs == 1


def test_compiled_logits_are_eager_logits_up_to_rounding():
    eager, compiled = _engine(False, engine="paged"), _engine(True, engine="paged")  # the same seeded weights
    ids = _prompts()[-1]
    for chunk in (None, 16, 1):  # the whole prompt, chunks after cached context, one token at a time
        want = prompt_logits(eager.model, ids, chunk_size=chunk, block_size=8)
        got = prompt_logits(compiled.model, ids, chunk_size=chunk, block_size=8, forward=compiled.runner.forward)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_compiled_engine_keeps_one_thread_count(monkeypatch):
    # torch's graph guards the thread count: a governor that moved it between steps
    # (another program got busy) would compile the whole step again inside a run.
    from minillm import threads

    monkeypatch.setattr(threads.ThreadGovernor, "tick", lambda self: pytest.fail("a compiled engine moved threads"))
    eng = _engine(True, engine="paged", block_size=8)
    assert eng.threads is None
    _greedy(eng, _prompts(2))
    if threads.ThreadGovernor().enabled:  # where the governor can read the load (/proc/stat), eager steps keep it
        assert isinstance(_engine(False, engine="paged", block_size=8).threads, threads.ThreadGovernor)


def test_compile_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="compile must be True or False"):
        EngineConfig(compile="yes")
    with pytest.raises(ValueError, match="compile=True needs attention_backend='cpu' or 'torch'"):
        resolve(EngineConfig(engine="paged", device="cpu", attention_backend="triton", compile=True), TINY)
    with pytest.raises(ValueError, match="cuda_graphs=True"):
        check_compile(torch.device("cuda"), "triton")
    assert not resolve(EngineConfig(engine="paged", device="cpu"), TINY).compile  # off by default


def test_compile_without_a_cxx_compiler_says_so(monkeypatch):
    import shutil

    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ValueError, match="needs a C..? compiler"):
        resolve(EngineConfig(engine="paged", device="cpu", compile=True), TINY)


@pytest.mark.slow
def test_smollm2_compiled_greedy_tokens_are_eager_tokens(real_llm):
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "Water boils at"]
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    compiled = LLM(engine="paged", compile=True)
    together = [o.token_ids for o in compiled.generate(prompts, sp)]
    alone = [compiled.generate([p], sp)[0].token_ids for p in prompts]
    eager = [o.token_ids for o in LLM(engine="paged").generate(prompts, sp)]
    assert together == alone == eager
