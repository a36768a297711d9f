"""CUDA graphs for decode steps: the option is checked up front, and replay changes no token."""
from __future__ import annotations

import pytest
import torch

from minillm import SamplingParams
from minillm.config import EngineConfig, ModelConfig
from minillm.engine import LLM, build_engine
from minillm.model_runner import graph_buckets
from minillm.resolve import resolve

TINY = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, max_position_embeddings=256)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_cuda_graphs_must_be_a_bool(value):
    with pytest.raises(ValueError, match="cuda_graphs must be True or False"):
        EngineConfig(cuda_graphs=value)
    with pytest.raises(ValueError, match="cuda_graphs must be True or False"):
        LLM(cuda_graphs=value)


def test_cuda_graphs_need_cuda():
    with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA device"):
        resolve(EngineConfig(engine="paged", device="cpu", cuda_graphs=True), TINY)
    assert resolve(EngineConfig(engine="paged", device="cpu"), TINY)  # off by default


@pytest.mark.gpu
def test_cuda_graphs_need_the_triton_backend():
    with pytest.raises(ValueError, match="attention_backend='triton'"):
        resolve(EngineConfig(engine="paged", device="cuda", attention_backend="torch", cuda_graphs=True), TINY)


def test_graph_buckets_cover_every_batch_size():
    for max_num_seqs in (1, 3, 8, 20, 256):
        buckets = graph_buckets(max_num_seqs)
        assert buckets[-1] == max_num_seqs and buckets == sorted(set(buckets))
        assert all(any(b >= n for b in buckets) for n in range(1, max_num_seqs + 1))


def _run(graphs: bool, dtype: str):
    cfg = EngineConfig(engine="paged", device="cuda", dtype=dtype, attention_backend="triton", max_model_len=128,
                       block_size=16, max_num_seqs=8, enable_chunked_prefill=True, cuda_graphs=graphs)
    engine = build_engine(cfg, model_config=TINY, tokenizer=None)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[(7 * i + j) % TINY.vocab_size for j in range(3 + 5 * i)] for i in range(5)]
    outs = engine.run([engine.make_request(p, params) for p in prompts])
    return engine, [o.token_ids for o in outs]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_same_greedy_tokens_with_and_without_graphs(dtype):
    _, eager = _run(False, dtype)
    engine, graphed = _run(True, dtype)
    assert engine.runner.graphs is not None and engine.runner.graphs.buckets == [1, 2, 4, 8]
    assert graphed == eager


@pytest.mark.gpu
def test_decode_steps_replay_and_prefill_steps_do_not():
    cfg = EngineConfig(engine="paged", device="cuda", dtype="bfloat16", max_model_len=128, max_num_seqs=4,
                       cuda_graphs=True)
    engine = build_engine(cfg, model_config=TINY, tokenizer=None)
    graphs = engine.runner.graphs
    replays = []
    real = graphs.replay
    graphs.replay = lambda b: replays.append(len(b.rows)) or real(b)
    engine.run([engine.make_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)),
                engine.make_request([4, 5, 6, 7], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))])
    assert replays == [2, 2, 2, 2]  # one prefill step eager, then four decode steps of two rows
    torch.cuda.synchronize()
