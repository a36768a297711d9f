"""bf16 on the CPU: a supported option that runs and is told apart from fp32 honestly.

Greedy fp32 is the exact reference (every exactness test runs in fp32). bf16 output is
compared by how many tokens agree before the first divergence, never asserted identical.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from minillm import placement
from minillm.config import EngineConfig, ModelConfig
from minillm.engine import build_engine
from minillm.bench.dtype_agreement import agreement
from minillm.sampling_params import SamplingParams

TINY = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, max_position_embeddings=256)


def _run(dtype, engine="paged"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eng = build_engine(EngineConfig(engine=engine, dtype=dtype, max_num_seqs=4, max_model_len=96, block_size=8),
                           model_config=TINY, tokenizer=None)
    g = torch.Generator().manual_seed(1)
    reqs = [eng.make_request(torch.randint(0, 128, (5 + 7 * i,), generator=g).tolist(),
                             SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)) for i in range(6)]
    return eng, [o.token_ids for o in eng.run(reqs)]


@pytest.mark.parametrize("engine", ["continuous", "paged"])
def test_bf16_engine_runs_on_the_cpu(engine):
    eng, out = _run("bfloat16", engine)
    assert eng.model.embed.weight.dtype == torch.bfloat16
    assert eng.runner.kv_caches[0][0].dtype == torch.bfloat16
    assert all(len(t) == 24 for t in out)
    ag = agreement(_run("float32", engine)[1], out)
    assert ag["requests"] == 6 and 0.0 <= ag["agreeing_fraction"] <= 1.0


def test_bf16_warns_only_without_bf16_matmul(monkeypatch):
    monkeypatch.setattr(placement, "cpu_has_bf16_matmul", lambda: False)
    with pytest.warns(UserWarning, match="bf16 matrix instructions"):
        placement.resolve("cpu", "bfloat16")
    monkeypatch.setattr(placement, "cpu_has_bf16_matmul", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        placement.resolve("cpu", "bfloat16")
        placement.resolve("cpu", "float32")


def test_agreement_counts_tokens_before_the_first_difference():
    assert agreement([[1, 2, 3]], [[1, 2, 3, 4]])["agreeing_prefix_tokens"] == [3]
    ag = agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [5, 6]])
    assert ag == {"requests": 2, "identical_requests": 1, "agreeing_prefix_tokens": [2, 2],
                  "agreeing_fraction": 4 / 6}
    with pytest.raises(ValueError, match="same requests"):
        agreement([[1]], [])
