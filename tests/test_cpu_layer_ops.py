"""The cpu backend's layer ops (minillm/kernels/cpu/layer_ops.py) against model.py's eager ops.

* RoPE with the K/V write equals ``apply_rope`` + ``write_kv`` bit for bit (float32 and bfloat16);
* the residual add is bit for bit; RMSNorm and silu(gate) * up equal model.py's within float
  rounding (float32: a few ulp; bfloat16: at most one bf16 step, nearly always the same bits);
* a token's bits do not depend on the other tokens of the call nor on the thread count;
* bad arguments are a ValueError, and a slot outside the cache writes nothing;
* a whole forward of the ``cpu`` backend (``Llama._cpu_layers``) equals the ``torch`` backend's
  on steps that mix prefills, chunks and decode rows.
"""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from minillm import model as M
from minillm.attention import write_kv
from minillm.config import ModelConfig
from minillm.kernels.cpu import build, layer_ops
from tests.test_step_cost import _meta

pytestmark = pytest.mark.skipif(build.compiler() is None, reason="no C++ compiler to build the CPU kernels")

DTYPES = [torch.float32, torch.bfloat16]


def _bf16_steps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance between a and b in bfloat16 steps (units in the last place)."""
    ia = a.view(torch.int16).int()
    ib = b.view(torch.int16).int()
    return int((ia - ib).abs().max())


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype == torch.bfloat16:
        assert _bf16_steps(got, want) <= 1
        assert (got == want).float().mean().item() > 0.995
    else:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,D", [(1, 576), (5, 64), (100, 40), (3, 7)])
def test_add_rms_norm_is_the_residual_add_then_model_rms_norm(dtype, T, D):
    torch.manual_seed(T + D)
    x, res = (torch.randn(T, D) * 3).to(dtype), torch.randn(T, D).to(dtype)
    w = (torch.rand(D) + 0.5).to(dtype)
    h, n = layer_ops.add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(h, res + x)  # the add rounds as torch's does: same bits
    _close(n, M.rms_norm(res + x, w, 1e-5))
    h0, n0 = layer_ops.add_rms_norm(x, None, w, 1e-5)  # no residual: a plain norm of x
    assert h0 is x
    _close(n0, M.rms_norm(x, w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_silu_of_the_gate_times_up(dtype):
    torch.manual_seed(0)
    gate = torch.cat([torch.randn(6, 300) * 4, torch.tensor([[0.0, -0.0, 1e-30, -100.0, -88.0, 87.0, 100.0, -20.0]
                                                            + [1.0] * 292])])
    up = torch.randn(7, 300)
    gu = torch.cat([gate, up], dim=1).to(dtype)
    got = layer_ops.silu_mul(gu)
    g, u = gu.chunk(2, dim=-1)
    want = F.silu(g) * u
    assert got.shape == (7, 300)
    if dtype == torch.float32:  # exp differs in the last bits: relative, not absolute
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-30)
    else:
        _close(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Hq,Hkv,D", [(9, 3, 64), (6, 2, 16), (4, 4, 10)])
def test_rope_write_is_apply_rope_then_write_kv_bit_for_bit(dtype, Hq, Hkv, D):
    torch.manual_seed(Hq * D)
    T = 37
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D).to(dtype)
    cos, sin = M.RopeTable(4096, D, 10000.0, "cpu")(torch.randint(0, 4096, (T,)))
    cos, sin = cos.to(dtype), sin.to(dtype)
    k_cache = torch.zeros(12, 4, Hkv, D, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    k_want, v_want = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(48)[:T]
    q = layer_ops.rope_write(qkv, cos, sin, slots, k_cache, v_cache, Hq)
    qk, v = qkv.split([(Hq + Hkv) * D, Hkv * D], dim=-1)
    qk = M.apply_rope(qk.reshape(T, Hq + Hkv, D), cos, sin)
    write_kv(qk[:, Hq:].contiguous(), v.reshape(T, Hkv, D), k_want, v_want, slots)
    assert torch.equal(q, qk[:, :Hq])
    assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)  # and every other slot still zero


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_token_gives_the_same_bits_alone_in_any_call_and_on_any_thread_count(dtype):
    torch.manual_seed(3)
    T, D = 130, 96  # more tokens than the ops run on one thread
    x, res = torch.randn(T, D).to(dtype), torch.randn(T, D).to(dtype)
    w = torch.rand(D).to(dtype)
    gu = torch.randn(T, 2 * D).to(dtype)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append((layer_ops.add_rms_norm(x, res, w, 1e-6)[1], layer_ops.silu_mul(gu)))
    finally:
        torch.set_num_threads(threads)
    for n, s in outs[1:]:
        assert torch.equal(n, outs[0][0]) and torch.equal(s, outs[0][1])
    alone = [layer_ops.add_rms_norm(x[i:i + 1], res[i:i + 1], w, 1e-6)[1] for i in (0, 64, 129)]
    assert all(torch.equal(a[0], outs[0][0][i]) for a, i in zip(alone, (0, 64, 129)))


def test_bad_arguments_are_a_value_error_and_a_bad_slot_writes_nothing():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="one dtype"):
        layer_ops.add_rms_norm(x, x.bfloat16(), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        layer_ops.silu_mul(torch.randn(8, 4).t())
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        layer_ops.silu_mul(torch.randn(4, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="weight"):
        layer_ops.add_rms_norm(x, None, torch.ones(7), 1e-5)
    qkv = torch.randn(2, (2 + 2) * 4)
    cos, sin = torch.ones(2, 4), torch.zeros(2, 4)
    k_cache, v_cache = torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 4)
    with pytest.raises(ValueError, match="outside the cache"):
        layer_ops.rope_write(qkv, cos, sin, torch.tensor([1, 4]), k_cache, v_cache, 2)
    assert not k_cache.any() and not v_cache.any()
    with pytest.raises(ValueError, match="query heads"):
        layer_ops.rope_write(qkv, cos, sin, torch.tensor([1, 2]), k_cache, v_cache, 3)


SMALL = ModelConfig(vocab_size=96, hidden_size=48, intermediate_size=80, num_layers=3, num_heads=6, num_kv_heads=2,
                    head_dim=8, max_position_embeddings=256)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_forward_through_the_layer_ops_equals_the_torch_backend(dtype):
    from minillm import loader

    weights = loader.dummy_weights(SMALL, 0)
    models = {b: M.build_model(SMALL, weights, torch.device("cpu"), dtype, attention_backend=b)
              for b in ("cpu", "torch")}
    rng = random.Random(0)
    torch.manual_seed(0)
    for trial in range(6):
        B = rng.randint(1, 6)
        qlens = [1 if rng.random() < 0.5 else rng.randint(2, 12) for _ in range(B)]
        ctxs = [max(n, rng.randint(1, 90)) for n in qlens]
        meta = {b: _meta(qlens, ctxs, 4, sum(-(-c // 4) for c in ctxs) + 2, random.Random(trial)) for b in models}
        T = sum(qlens)
        ids = torch.randint(0, SMALL.vocab_size, (T,))
        pos = torch.tensor([p for n, c in zip(qlens, ctxs) for p in range(c - n, c)])
        nb = int(meta["cpu"].block_tables.max()) + 2
        shape = (nb, 4, SMALL.num_kv_heads, SMALL.head_dim)
        past = [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(SMALL.num_layers)]
        caches = {b: [(k.clone(), v.clone()) for k, v in past] for b in models}
        with torch.inference_mode():
            out = {b: models[b](ids, pos, meta[b], caches[b]) for b in models}
        tol = 1e-5 if dtype == torch.float32 else 0.1
        assert (out["cpu"].float() - out["torch"].float()).abs().max().item() < tol
        for (kc, vc), (kt, vt) in zip(caches["cpu"], caches["torch"]):
            assert (kc.float() - kt.float()).abs().max().item() < tol
            assert (vc.float() - vt.float()).abs().max().item() < tol


def test_a_plugged_decode_attention_runs_inside_the_cpu_backend_forward():
    from minillm import seams
    from minillm.config import EngineConfig
    from minillm.engine import build_engine
    from minillm.sampling_params import SamplingParams
    from solutions import ch03_paged_attention as s03

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (5, 17, 2)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run(backend):
        cfg = EngineConfig(engine="paged", max_num_seqs=3, max_model_len=64, block_size=4, cpu_threads=None,
                           attention_backend=backend)
        eng = build_engine(cfg, model_config=SMALL, tokenizer=None)
        return [o.token_ids for o in eng.run([eng.make_request(p, params) for p in prompts])]

    calls = []

    def mine(*args):
        calls.append(1)
        return s03.paged_decode_attention(*args)

    with seams.plug(paged_decode_attention=mine):
        got = run("cpu")
    assert calls  # the learner's function attended the decode rows
    assert got == run("torch")


def test_forward_ops_refuse_a_layer_whose_caches_differ():
    T, Hq, Hkv, D = 2, 4, 2, 8
    h = torch.randn(T, 32)
    cos, sin = torch.ones(T, D), torch.zeros(T, D)
    meta = _meta([1, 1], [3, 5], 4, 6, random.Random(0))
    caches = (torch.zeros(6, 4, Hkv, D), torch.zeros(6, 4, Hkv, D))
    ops = layer_ops.ForwardOps(h, cos, sin, meta, Hq, [caches], 16, None)
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D)
    ops.rope_write(qkv, 0)
    with pytest.raises(ValueError, match="every layer's caches"):
        layer_ops.ForwardOps(h, cos, sin, meta, Hq, [caches, (torch.zeros(7, 4, Hkv, D), torch.zeros(7, 4, Hkv, D))],
                             16, None)
    with pytest.raises(ValueError, match="contiguous"):
        ops.silu_mul(torch.randn(32, T).t())
