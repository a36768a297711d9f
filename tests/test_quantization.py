"""Weight-only quantization (minillm/quantization.py): formats, the layer against its oracle,
batch invariance in every engine, quality on the real model, and clear errors."""
from __future__ import annotations

import warnings

import pytest
import torch

from minillm.config import EngineConfig, ModelConfig
from minillm.engine import build_engine
from minillm.quantization import (GROUP_SIZE, QuantizedLinear, bits_per_weight, dequantize_groups,
                                  dequantize_int8_channel, quantize_groups, quantize_int8_channel, quantize_model,
                                  weight_bytes_per_step)
from minillm.sampling_params import SamplingParams

TINY = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, max_position_embeddings=256)


def _cpu_kernels():
    from minillm.kernels.cpu import build

    try:
        build.library()
    except RuntimeError as e:
        pytest.skip(f"no CPU kernels: {e}")


# ---------------------------------------------------------------- formats

def test_int8_channel_round_trip_is_within_half_a_step_per_row():
    w = torch.randn(33, 70, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.1, 3, 33)[:, None]
    w[5] = 0.0                                                    # an all-zero row: scale 1, codes 0
    q, scale = quantize_int8_channel(w)
    assert q.dtype == torch.int8 and scale.shape == (33,) and int(q.abs().max()) == 127
    back = dequantize_int8_channel(q, scale)
    assert bool(((back - w).abs() <= scale[:, None] / 2 + 1e-7).all())
    assert bool((back[5] == 0).all())


@pytest.mark.parametrize("bits", [4, 8])
def test_group_round_trip_is_within_half_a_step(bits):
    w = torch.randn(7, 64, generator=torch.Generator().manual_seed(1))
    w[2, :32] = 0.25                                              # a constant group: exact
    codes, scales, mins = quantize_groups(w, bits)
    assert codes.dtype == torch.uint8 and codes.shape == (7, 64) and scales.shape == mins.shape == (7, 2)
    assert int(codes.max()) == 2 ** bits - 1 and int(codes.min()) == 0
    back = dequantize_groups(codes, scales, mins)
    assert bool(((back - w).abs() <= scales.repeat_interleave(GROUP_SIZE, dim=1) / 2 + 1e-6).all())
    assert bool((back[2, :32] == 0.25).all())
    with pytest.raises(ValueError, match="multiple of the group size"):
        quantize_groups(torch.randn(4, 40), bits)


def _gguf_like(kind, g):
    """Weights on the grid of a GGUF block format, as the loader's float32 weights are: Q4_1 (per group
    of 32 a scale d and minimum m, w = m + d * q, q in 0..15, both ends used) or Q8_0 (w = d * c, c in
    -127..127, the largest |c| = 127), scales and minimums rounded through float16 as the file stores them."""
    d = (torch.rand(6, 4, 1, generator=g) * 0.05 + 0.01).half().float()
    if kind == "q4_1":
        m = (-torch.rand(6, 4, 1, generator=g) * 0.2).half().float()
        q = torch.randint(0, 16, (6, 4, 32), generator=g).float()
        q[..., 0], q[..., 1] = 0, 15
        return (m + d * q).view(6, 128)
    c = torch.randint(-127, 128, (6, 4, 32), generator=g).float()
    c[..., 0] = 127
    return (d * c).view(6, 128)


@pytest.mark.parametrize("kind,bits,symmetric", [("q4_1", 4, False), ("q4_1", 8, False), ("q8_0", 8, True)])
def test_formats_hold_the_files_grids_exactly(kind, bits, symmetric):
    """The claim behind the schemes: 4- and 8-bit asymmetric groups of 32 hold Q4_1 weights, symmetric
    8-bit groups hold Q8_0 weights, to float32 rounding of scale * code + min."""
    w = _gguf_like(kind, torch.Generator().manual_seed(4))
    back = dequantize_groups(*quantize_groups(w, bits, symmetric=symmetric))
    torch.testing.assert_close(back, w, rtol=0, atol=2e-7)
    channel = dequantize_int8_channel(*quantize_int8_channel(w))  # one scale per row: rounds again
    assert (channel - w).abs().max() > 1e-4


def test_bits_per_weight():
    assert bits_per_weight(None) == 32.0
    assert bits_per_weight("int8_channel", in_features=576) == pytest.approx(8 + 32 / 576)
    assert bits_per_weight("int8_group") == 10.0 and bits_per_weight("q4_group") == 6.0


@pytest.mark.parametrize("fmt", ["int8_channel", "int8_group", "q4_group"])
def test_layer_matches_its_oracle(fmt):
    _cpu_kernels()
    g = torch.Generator().manual_seed(2)
    layer = QuantizedLinear(torch.randn(96, 64, generator=g), fmt)
    x = torch.randn(2, 5, 64, generator=g)
    y = layer(x)
    assert y.shape == (2, 5, 96) and y.dtype == torch.float32
    torch.testing.assert_close(y, layer.forward_reference(x), rtol=1e-5, atol=1e-4)
    assert not torch.equal(y, torch.nn.functional.linear(x, layer.dense() + 1e-3))  # the oracle can tell
    xb = x.bfloat16()  # bfloat16 activations: the float32 result for x widened, rounded once
    yb = layer(xb)
    assert yb.shape == (2, 5, 96) and yb.dtype == torch.bfloat16
    assert torch.equal(yb, layer(xb.float()).bfloat16())
    torch.testing.assert_close(yb, layer.forward_reference(xb))  # bfloat16's tolerance


def test_a_moved_or_copied_layer_binds_its_own_weights():
    """The layer binds its weights to the kernel on its first call; new buffers (a load, a copy)
    are bound again, never read through the old pointers."""
    import copy

    _cpu_kernels()
    g = torch.Generator().manual_seed(4)
    a, b = QuantizedLinear(torch.randn(16, 64, generator=g), "q4_group"), QuantizedLinear(torch.randn(16, 64), "q4_group")
    x = torch.randn(3, 64, generator=g)
    ya = a(x)
    twin = copy.deepcopy(a)
    a.qweight, a.scales, a.mins = b.qweight, b.scales, b.mins
    assert torch.equal(a(x), b(x)) and not torch.equal(a(x), ya)
    assert torch.equal(twin(x), ya)


def test_layer_refuses_other_activations():
    _cpu_kernels()
    layer = QuantizedLinear(torch.randn(8, 32), "int8_group")
    with pytest.raises(ValueError, match="float32 or bfloat16 activations on the CPU"):
        layer(torch.randn(1, 32, dtype=torch.float16))
    for shape in ((2, 31), (2, 3, 33)):
        with pytest.raises(ValueError, match=r"x must be \[..., in_features\] = \[..., 32\]"):
            layer(torch.randn(*shape))
    with pytest.raises(ValueError, match="format must be one of"):
        QuantizedLinear(torch.randn(8, 32), "int4")


# ---------------------------------------------------------------- the model and the engines

def _engine(scheme, engine="paged", dtype="float32", **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_engine(EngineConfig(engine=engine, device="cpu", dtype=dtype, max_model_len=128,
                                         quantization=scheme, **kw), model_config=TINY, tokenizer=None)


def _prompts(n=6):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 128, (4 + 9 * i,), generator=g).tolist() for i in range(n)]


GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.mark.parametrize("scheme", ["int8", "q4"])
def test_quantize_model_replaces_every_projection_and_the_head(scheme):
    _cpu_kernels()
    eng = _engine(scheme)
    m = eng.model
    for layer in m.layers:
        for mod in (layer.attn.qkv_proj, layer.attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert isinstance(mod, QuantizedLinear) and mod.fmt == {"int8": "int8_group", "q4": "q4_group"}[scheme]
    assert isinstance(m.quantized_head, QuantizedLinear) and m.quantized_head.fmt == "int8_group"
    assert m.embed.weight.dtype == torch.float32
    float_eng = _engine(None)
    ratio = weight_bytes_per_step(m) / weight_bytes_per_step(float_eng.model)
    assert ratio < (0.33 if scheme == "int8" else 0.25)
    # the quantized engine computes with other weights: close to the float engine's logits, not equal
    ids = _prompts(1)[0]
    from minillm.model_runner import prompt_logits

    a, b = prompt_logits(float_eng.model, ids), prompt_logits(m, ids)
    d = (a - b).abs().mean().item()
    assert 0 < d < (0.05 if scheme == "int8" else 0.25) * a.abs().mean().item()


@pytest.mark.parametrize("scheme", ["int8", "q4"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("engine,options", [
    ("continuous", {}),
    ("paged", {}),
    ("paged", {"enable_chunked_prefill": True, "max_num_batched_tokens": 16}),
    ("paged", {"num_blocks": 16, "block_size": 8}),               # a pool too small for all six: preemption
])
def test_every_request_gets_its_tokens_alone(scheme, backend, engine, options):
    _cpu_kernels()
    prompts = _prompts()
    alone = []
    for p in prompts:
        e = _engine(scheme, engine, attention_backend=backend, max_num_seqs=1, **options)
        alone.append(e.run([e.make_request(p, GREEDY)])[0].token_ids)
    batched = _engine(scheme, engine, attention_backend=backend, max_num_seqs=4, **options)
    out = [o.token_ids for o in batched.run([batched.make_request(p, GREEDY) for p in prompts])]
    assert out == alone
    if options.get("num_blocks"):
        assert batched.scheduler.num_preemptions > 0
    if engine == "paged":
        batched.scheduler.block_manager.check_invariants()
        assert batched.scheduler.block_manager.num_free_blocks == batched.scheduler.block_manager.num_blocks


@pytest.mark.parametrize("scheme", ["int8", "q4"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_bfloat16_activations_keep_every_requests_tokens_alone(scheme, backend):
    """A quantized engine in bfloat16 on the CPU: batched, chunked and preempted, each request
    gets its tokens alone; its logits are those of the float32 activations within bfloat16's
    rounding, not equal to them."""
    _cpu_kernels()
    prompts = _prompts()
    options = dict(attention_backend=backend, enable_chunked_prefill=True, max_num_batched_tokens=16,
                   num_blocks=16, block_size=8)
    alone = []
    for p in prompts:
        e = _engine(scheme, dtype="bfloat16", max_num_seqs=1, **options)
        alone.append(e.run([e.make_request(p, GREEDY)])[0].token_ids)
    batched = _engine(scheme, dtype="bfloat16", max_num_seqs=4, **options)
    assert batched.model.layers[0].mlp.down_proj.qweight.dtype == torch.uint8
    out = [o.token_ids for o in batched.run([batched.make_request(p, GREEDY) for p in prompts])]
    assert out == alone
    assert batched.scheduler.num_preemptions > 0
    batched.scheduler.block_manager.check_invariants()
    assert batched.scheduler.block_manager.num_free_blocks == batched.scheduler.block_manager.num_blocks
    from minillm.model_runner import prompt_logits

    a = prompt_logits(_engine(scheme).model, prompts[2])
    b = prompt_logits(batched.model, prompts[2])
    d = (a - b.float()).abs().mean().item()
    assert 0 < d < 0.05 * a.abs().mean().item()


def test_speculation_keeps_quantized_greedy_output():
    _cpu_kernels()
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10, 11, 9]]
    plain = _engine("int8", max_num_seqs=2)
    spec = _engine("int8", max_num_seqs=2, speculative={"method": "ngram", "num_speculative_tokens": 3})
    ref = [o.token_ids for o in plain.run([plain.make_request(p, GREEDY) for p in prompts])]
    assert [o.token_ids for o in spec.run([spec.make_request(p, GREEDY) for p in prompts])] == ref


@pytest.mark.parametrize("options,match", [
    (dict(quantization="int4"), "quantization must be None"),
    (dict(quantization="int8", dtype="float16"), "takes float32 or bfloat16 activations"),
    (dict(quantization="q4", pack_weights=True), "pack_weights=True"),
    (dict(quantization="int8", compile=True, attention_backend="torch"), "compile=True"),
])
def test_bad_combinations_are_clear_errors(options, match):
    kw = dict(engine="paged", device="cpu", max_model_len=64) | options
    with pytest.raises(ValueError, match=match):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            build_engine(EngineConfig(**kw), model_config=TINY, tokenizer=None)


def test_a_packed_model_quantizes_to_the_same_codes():
    from minillm import loader
    from minillm.model import build_model, can_pack_weights

    if not can_pack_weights(torch.float32):
        pytest.skip("oneDNN packing unavailable")
    w = loader.dummy_weights(TINY, 0)
    plain, packed = (quantize_model(build_model(TINY, w, torch.device("cpu"), torch.float32, pack_weights=p), "q4")
                     for p in (False, True))
    assert packed.packed_head is None
    for a, b in zip(plain.buffers(), packed.buffers()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("scheme", ["int8", "q4"])
def test_a_quantized_self_draft_keeps_the_targets_layers_and_its_output(scheme):
    """speculative={"quantization": ...}: the draft's layers are quantized copies, the target's stay
    float, and greedy output is the target's own."""
    _cpu_kernels()
    prompts = _prompts(3)
    plain = _engine(None, max_num_seqs=3)
    ref = [o.token_ids for o in plain.run([plain.make_request(p, GREEDY) for p in prompts])]
    spec = _engine(None, max_num_seqs=3, speculative={"method": "model", "draft_layers": [0],
                                                      "num_speculative_tokens": 3, "quantization": scheme,
                                                      "disable_by_batch_size": None})
    draft = spec.speculator.drafter.model
    assert isinstance(draft.layers[0].mlp.down_proj, QuantizedLinear) and draft.quantized_head is not None
    assert not isinstance(spec.model.layers[0].mlp.down_proj, QuantizedLinear) and spec.model.quantized_head is None
    assert [o.token_ids for o in spec.run([spec.make_request(p, GREEDY) for p in prompts])] == ref
    assert spec.speculator.stats.num_drafts > 0


def test_speculative_quantization_is_an_option_of_the_drafting_methods():
    with pytest.raises(ValueError, match="quantization is an option of the 'model' and 'medusa' methods"):
        EngineConfig(engine="paged", speculative={"method": "ngram", "quantization": "int8"})
    EngineConfig(engine="paged", speculative={"method": "medusa", "quantization": "q4"})
    with pytest.raises(ValueError, match="speculative quantization must be"):
        EngineConfig(engine="paged", speculative={"method": "model", "draft_layers": [0], "quantization": "fp8"})


# ---------------------------------------------------------------- the real model

@pytest.mark.slow
def test_quality_on_the_real_model(real_llm, tokenizer):
    """Teacher-forced on the float model's own greedy text. The schemes' formats hold the GGUF's
    grids (test_formats_hold_the_files_grids_exactly), so int8 and q4 give the float model's
    logits up to float32 summation order: argmax agreement >= 99.5%, |Δlogit| below 1e-3 on average.
    One scale per row (int8_channel) rounds the weights again: measurably worse."""
    _cpu_kernels()
    from minillm import loader
    from minillm.bench.quant_measure import HELDOUT_TEXT, models_for, perplexity, teacher_forced
    from tests.prompts import SHORT

    outs = real_llm.generate(SHORT, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    seqs = [tokenizer(p).input_ids + list(o.token_ids) for p, o in zip(SHORT, outs)]
    models = models_for(loader.load_weights(), [None, "int8", "q4", "int8_channel"])
    got = {k: teacher_forced(models[None], models[k], seqs) for k in ("int8", "q4", "int8_channel")}
    for k in ("int8", "q4"):
        assert got[k]["argmax_agreement"] >= 0.995 and got[k]["mean_abs_dlogit"] < 1e-3, (k, got[k])
    assert got["int8_channel"]["mean_abs_dlogit"] > 20 * got["int8"]["mean_abs_dlogit"], got
    held = tokenizer(HELDOUT_TEXT).input_ids
    p32, p8, p4 = (perplexity(models[k], held) for k in (None, "int8", "q4"))
    assert abs(p8 / p32 - 1) < 1e-3 and abs(p4 / p32 - 1) < 1e-3, (p32, p8, p4)


# ---------------------------------------------------------------- from the shell

def test_bench_quantization_flag_runs_every_minillm_engine_quantized(tmp_path):
    """``bench --quantization int8`` on dummy weights: both engines run quantized, same tokens."""
    _cpu_kernels()
    import json

    from minillm.__main__ import main

    out = tmp_path / "b.json"
    main(["bench", "--engine", "continuous,paged", "--quantization", "int8", "--dummy-weights", "--workload",
          "uniform", "--num-requests", "2", "--workload-param", "prompt_len=8", "--workload-param", "output_len=3",
          "--max-num-seqs", "2", "--no-progress", "--threads", "1", "--json", str(out)])
    rows = json.loads(out.read_text())                            # {engine: summary}
    assert sorted(rows) == ["continuous", "paged"]
    assert all(r["same_tokens_as"]["fraction"] == 1.0 for r in rows.values())
    assert all(r.get("quantization") == "int8" for r in rows.values()), rows


@pytest.mark.parametrize("argv", [["generate", "hi", "--quantization", "int4"],
                                  ["bench", "--quantization", "fp8", "--dummy-weights"]])
def test_an_unknown_scheme_is_a_usage_error(argv, capsys):
    from minillm.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and "--quantization" in capsys.readouterr().err


def test_serve_flags_reach_the_engine_options():
    from minillm.serving.cli import _serve_parser, engine_kwargs_from_args

    args = _serve_parser().parse_args(["--quantization", "q4", "--speculative-method", "model", "--draft-layers",
                                       "0,1", "--draft-quantization", "int8"])
    kw = engine_kwargs_from_args(args)
    assert kw["quantization"] == "q4" and kw["speculative"]["quantization"] == "int8"
    EngineConfig.from_kwargs(**kw)
    with pytest.raises(ValueError, match="need --speculative-method"):
        engine_kwargs_from_args(_serve_parser().parse_args(["--draft-quantization", "int8"]))


def test_logits_agreement_and_perplexity_of_logits():
    """The logits-level measures (what llama.cpp's logits are compared with): exact values on
    hand-made logits, and a ValueError for logits of other positions."""
    import math

    from minillm.bench.quant_measure import logits_agreement, perplexity_of

    a = [torch.tensor([[2.0, 0.0, 0.0], [0.0, 3.0, 0.0]]), torch.tensor([[0.0, 0.0, 1.0]])]
    b = [torch.tensor([[2.0, 0.0, 0.5], [4.0, 3.0, 0.0]]), torch.tensor([[0.0, 0.0, 1.0]])]
    q = logits_agreement(a, b)
    assert q["positions"] == 3 and q["argmax_agreement"] == pytest.approx(2 / 3)
    assert q["mean_abs_dlogit"] == pytest.approx((0.5 / 3 + 4 / 3 + 0) / 3) and q["max_abs_dlogit"] == 4.0
    with pytest.raises(ValueError, match="not the same positions"):
        logits_agreement(a, [b[0], torch.zeros(2, 3)])
    uniform = torch.zeros(4, 5)  # p = 1/5 for every token: perplexity 5
    assert perplexity_of(uniform, [0, 1, 2, 3]) == pytest.approx(5.0)
    sure = torch.full((3, 5), -30.0)
    sure[0, 2] = sure[1, 4] = 30.0  # the tokens that follow, nearly certain
    assert perplexity_of(sure, [1, 2, 4]) == pytest.approx(1.0, abs=1e-6) and not math.isnan(perplexity_of(sure, [1, 2, 4]))


def test_the_cpu_kernels_stream_float16_scales_where_they_hold_the_weights_exactly():
    """Weights on the GGUF's grids (float16 scales and minimums): the layer streams 2 bytes of each,
    for the same results as float32 scales; other weights keep float32 scales."""
    _cpu_kernels()
    g = torch.Generator().manual_seed(5)
    d = (torch.rand(16, 4, 1, generator=g) * 0.05 + 0.01).half().float()
    m = (-torch.rand(16, 4, 1, generator=g) * 0.2).half().float()
    q = torch.randint(0, 16, (16, 4, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    on_grid = QuantizedLinear((m + d * q).view(16, 128), "q4_group")
    other = QuantizedLinear(torch.randn(16, 128, generator=g), "q4_group")
    x = torch.randn(3, 128, generator=g)
    from minillm.kernels.cpu.quant import q4_linear

    y = on_grid(x)
    torch.testing.assert_close(y, on_grid.forward_reference(x), rtol=1e-5, atol=1e-5)
    assert torch.equal(y, q4_linear(x, on_grid.qweight, on_grid.scales, on_grid.mins, 32))  # float32 scales
    other(x)
    assert on_grid._bound.half_scales and not other._bound.half_scales
    codes = 16 * 128 // 2
    assert on_grid.nbytes == codes + 2 * 16 * 4 * 4 and on_grid.read_nbytes == codes + 2 * 16 * 4 * 2
    assert other.read_nbytes == other.nbytes
