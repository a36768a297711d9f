"""CPU linears in oneDNN's packed layout (``model.PackedLinear``, ``EngineConfig.pack_weights``).

Packing changes the summation order of each matrix product, not what is computed: the
products agree with ``F.linear`` to rounding, and the engines' greedy tokens are the
same packed or not (the exactness tests of every engine run packed, the default in fp32).
"""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from minillm import SamplingParams
from minillm.config import EngineConfig, ModelConfig
from minillm.engine import build_engine
from minillm.model import PackedLinear, can_pack_weights, packs_by_default
from minillm.resolve import resolve

needs_packing = pytest.mark.skipif(not can_pack_weights(torch.float32),
                                   reason="this torch build or CPU has no oneDNN packed linear")
TINY = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4, num_kv_heads=2,
                   head_dim=16, max_position_embeddings=256)


@needs_packing
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_packed_linear_is_f_linear_up_to_rounding(rows):
    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(160, 96, generator=g), torch.randn(rows, 96, generator=g)
    m = PackedLinear(w)
    torch.testing.assert_close(m(x), F.linear(x, w), atol=1e-5, rtol=1e-5)
    assert torch.equal(m.dense(), w)  # the dense weight comes back exactly
    assert [(n, p.numel()) for n, p in m.named_parameters()] == [("weight", w.numel())]  # counted as nn.Linear's
    x_t = torch.randn(96, rows, generator=g).t()  # a non-contiguous input
    torch.testing.assert_close(m(x_t), F.linear(x_t, w), atol=1e-5, rtol=1e-5)


def _engine(engine: str, pack, **kw):
    cfg = EngineConfig(engine=engine, device="cpu", dtype="float32", max_model_len=96, max_num_seqs=4,
                       pack_weights=pack, cpu_threads=None, **kw)
    return build_engine(cfg, model_config=TINY, tokenizer=None)


@pytest.mark.skipif(not packs_by_default(torch.float32),
                    reason="packing is on by default on x86 CPUs that run it only (where it was measured)")
@pytest.mark.filterwarnings("ignore:dtype='bfloat16' on a CPU without")
def test_auto_packs_fp32_on_the_cpu_and_bf16_where_the_cpu_multiplies_bf16(monkeypatch):
    packed = _engine("paged", None)
    assert packed.resolved.pack_weights
    assert isinstance(packed.runner.model.layers[0].mlp.down_proj, PackedLinear)
    assert packed.runner.model.packed_head is not None
    plain = _engine("paged", False)
    assert not plain.resolved.pack_weights and isinstance(plain.runner.model.layers[0].mlp.down_proj, torch.nn.Linear)
    from minillm import placement

    for native in (True, False):  # bf16 packs where the CPU has bf16 matrix instructions (measured to pay)
        monkeypatch.setattr(placement, "cpu_has_bf16_matmul", lambda: native)
        bf16 = resolve(EngineConfig(engine="paged", device="cpu", dtype="bfloat16", max_model_len=96), TINY)
        assert bf16.pack_weights == (native and can_pack_weights(torch.bfloat16)), native


@pytest.mark.parametrize("bad", ["yes", 1, 0.0])
def test_pack_weights_must_be_a_bool_or_none(bad):
    with pytest.raises(ValueError, match="pack_weights"):
        EngineConfig(pack_weights=bad)


@needs_packing
@pytest.mark.parametrize("engine,kw", [
    ("continuous", {}),
    ("paged", {"block_size": 8, "enable_chunked_prefill": True, "max_num_batched_tokens": 16}),
    ("paged", {"block_size": 8, "speculative": {"method": "model", "draft_layers": [0, 2],
                                                "num_speculative_tokens": 3}}),
], ids=["continuous", "paged-chunked", "paged-self-draft"])
def test_greedy_tokens_the_same_packed_or_not(engine, kw):
    prompts = [[3, 14, 15, 92, 65, 35], [8, 9, 7, 9], list(range(10, 40)), [42]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for pack in (False, True):
        e = _engine(engine, pack, **kw)
        outs[pack] = [o.token_ids for o in e.run([e.make_request(p, params) for p in prompts])]
    assert outs[True] == outs[False]
