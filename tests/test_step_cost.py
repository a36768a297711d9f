"""A batched decode step costs about what a batch-1 step costs, and computes the same thing.

On a CPU a decode step of a 135M model is short enough that every op the step dispatches
shows (each costs microseconds of dispatch whatever its size). The torch backend used to
attend one request at a time, so a batch-32 step dispatched ~10x the ops of a batch-1
step; adjacent decode rows now attend in one call (``attention.decode_groups``). These
tests keep that true and keep the numbers right:

* ``decode_groups`` groups adjacent decode rows and splits where padding would be large;
* grouped attention equals per-row attention over exactly each row's keys (fp32 and bf16);
* the ops dispatched by a decode step grow by at most a few per row;
* ``rms_norm`` through ``F.rms_norm`` is bit for bit the spelled-out float32 formula.
"""
from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minillm.attention import AttentionMetadata, decode_groups, torch_attention
from minillm.config import EngineConfig, ModelConfig
from minillm.engine import build_engine
from minillm.kernels import paged_attention_ref
from minillm.model import rms_norm
from minillm.sampling_params import SamplingParams

TINY = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=6,
                   num_kv_heads=2, head_dim=16, max_position_embeddings=512)


def test_decode_groups_joins_adjacent_decode_rows_of_similar_length():
    assert decode_groups([1, 1, 1], [10, 20, 30]) == [(0, 3, 30)]
    # a prefill row splits the run, and is never in a group
    assert decode_groups([1, 5, 1, 1], [10, 5, 12, 14]) == [(0, 1, 10), (2, 2, 14)]
    # a long row next to short ones: padding the short ones to it would cost more than the call
    assert decode_groups([1, 1, 1, 1], [20, 30, 2000, 25]) == [(0, 2, 30), (2, 1, 2000), (3, 1, 25)]
    # within the allowance: 4 rows padded to 300 (waste 1200 - 1090 = 110 keys)
    assert decode_groups([1] * 4, [250, 270, 270, 300]) == [(0, 4, 300)]
    assert decode_groups([], []) == []
    assert decode_groups([3], [3]) == []


def _meta(qlens, ctxs, block_size, num_blocks, rng):
    """Block tables with shuffled block ids, and the flat metadata of one step."""
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables = []
    for c in ctxs:
        n = -(-c // block_size)
        tables.append([ids.pop() for _ in range(n)])
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in tables]
    starts = [0]
    for n in qlens:
        starts.append(starts[-1] + n)
    slots = []
    for t, n, c in zip(tables, qlens, ctxs):
        slots += [t[p // block_size] * block_size + p % block_size for p in range(c - n, c)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), block_tables=torch.tensor(padded, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32), context_lens=torch.tensor(ctxs, dtype=torch.int32),
        block_size=block_size, query_lens_list=list(qlens), context_lens_list=list(ctxs),
        block_tables_list=padded)


def _per_row(q, k_cache, v_cache, meta, scale):
    """The oracle (``kernels.paged_attention_ref``): every query over exactly its sequence's keys."""
    return paged_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.context_lens, scale)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_grouped_decode_attention_matches_each_row_alone(dtype, tol):
    rng = random.Random(0)
    torch.manual_seed(0)
    Hq, Hkv, D, bs = 6, 2, 16, 4
    for trial in range(12):
        B = rng.randint(1, 9)
        qlens = [1 if rng.random() < 0.8 else rng.randint(2, 5) for _ in range(B)]
        ctxs = [max(n, rng.choice([rng.randint(1, 40), rng.randint(1, 400)])) for n in qlens]
        meta = _meta(qlens, ctxs, bs, sum(-(-c // bs) for c in ctxs) + 3, rng)
        nb = meta.block_tables.max().item() + 4
        k_cache = torch.randn(nb, bs, Hkv, D).to(dtype)
        v_cache = torch.randn(nb, bs, Hkv, D).to(dtype)
        q = torch.randn(sum(qlens), Hq, D).to(dtype)
        got = torch_attention(q, k_cache, v_cache, meta, 0.25)
        want = _per_row(q.float(), k_cache.float(), v_cache.float(), meta, 0.25)
        assert (got.float() - want).abs().max().item() < tol, (qlens, ctxs)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("engine", ["continuous", "paged"])
def test_decode_step_ops_grow_by_a_few_per_row(engine):
    """Ops dispatched by one pure-decode step at batch 1 and batch 24 (24 rows of similar context)."""
    counts = {}
    for B in (1, 24):
        eng = build_engine(EngineConfig(engine=engine, max_num_seqs=24, max_model_len=128, block_size=8,
                                        cpu_threads=None), model_config=TINY, tokenizer=None)
        g = torch.Generator().manual_seed(B)
        for _ in range(B):
            eng.add_request(torch.randint(0, 128, (20,), generator=g).tolist(),
                            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        while any(r.is_prefill for r in [*eng.scheduler.waiting, *eng.scheduler.running]):
            eng.step()  # prefill every request (the token budget spreads it over steps)
        eng.step()
        ops = _Ops()
        with ops:
            eng.step()
        counts[B] = ops.n
    per_row = (counts[24] - counts[1]) / 23
    # One SDPA per request per layer costs ~8 ops (views, gathers, the call, the copy out):
    # 16 per row for this 2-layer model. Grouped, a row adds (almost) nothing.
    assert per_row < 1.0, counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_is_the_spelled_out_formula_bit_for_bit(dtype):
    torch.manual_seed(0)
    x = (torch.randn(37, 576) * 3).to(dtype)
    w = torch.randn(576).to(dtype)
    xf = x.float()
    want = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    assert torch.equal(rms_norm(x, w, 1e-5), want)
