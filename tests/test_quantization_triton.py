"""Quantized layers on the Triton path (what ``QuantizedLinear`` runs on CUDA), checked on the
CPU in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU): the
layer against its oracle in every activation dtype, a model quantized from a float32 source,
and the engine's greedy tokens with every quantized layer on the Triton path."""
from __future__ import annotations

import warnings

import pytest
import torch

from minillm.config import EngineConfig, ModelConfig
from minillm.engine import build_engine
from minillm.kernels import HAS_TRITON
from minillm.quantization import QuantizedLinear, quantize_model
from minillm.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

TINY = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, max_position_embeddings=256)


def _on_gpu() -> bool:
    return torch.cuda.is_available()


@pytest.mark.parametrize("fmt,symmetric", [("int8_group", False), ("int8_group", True), ("q4_group", False)],
                         ids=["int8", "int8-symmetric", "q4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_triton_forward_matches_the_oracle(fmt, symmetric, dtype):
    g = torch.Generator().manual_seed(5)
    layer = QuantizedLinear(torch.randn(96, 128, generator=g), fmt, symmetric=symmetric)
    x = torch.randn(3, 4, 128, generator=g)
    if _on_gpu():
        layer, x = layer.cuda(), x.cuda()
    y = layer.forward_triton(x.to(dtype))
    assert y.shape == (3, 4, 96) and y.dtype == dtype and y.device == x.device
    want = layer.forward_reference(x.to(dtype).float())  # float64 sums of the same rounded x
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(y.float(), want, rtol=tol, atol=tol * want.abs().max().item())
    wrong = torch.nn.functional.linear(x.to(dtype).float(), layer.dense() * 1.05)  # scales 5% off
    assert not torch.allclose(y.float(), wrong, rtol=tol, atol=tol * want.abs().max().item())  # the check can tell


def test_one_scale_per_row_has_no_triton_kernel():
    layer = QuantizedLinear(torch.randn(8, 32), "int8_channel")
    with pytest.raises(ValueError, match="int8_channel .* has no Triton kernel"):
        layer.forward_triton(torch.randn(1, 32))


def test_a_model_is_quantized_from_its_float32_source():
    """A bfloat16 model quantized from the float32 model: the same codes as the float32 model's
    own, not those of its bfloat16-rounded weights; the quantized layers on the model's device."""
    from minillm import loader
    from minillm.model import build_model

    w = loader.dummy_weights(TINY, seed=0)
    cpu = torch.device("cpu")
    ref = quantize_model(build_model(TINY, w, cpu, torch.float32), "q4")
    bf16 = build_model(TINY, w, cpu, torch.bfloat16)
    rounded = quantize_model(build_model(TINY, w, cpu, torch.bfloat16).float(), "q4")  # from bf16 weights
    quantize_model(bf16, "q4", source=build_model(TINY, w, cpu, torch.float32))
    for a, b, c in zip(ref.layers, bf16.layers, rounded.layers):
        assert torch.equal(a.mlp.down_proj.qweight, b.mlp.down_proj.qweight)
        assert torch.equal(a.attn.qkv_proj.scales, b.attn.qkv_proj.scales)
    assert torch.equal(ref.quantized_head.qweight, bf16.quantized_head.qweight)
    assert bf16.quantized_head.scales.dtype == torch.float32 and bf16.embed.weight.dtype == torch.bfloat16
    differs = any(not torch.equal(a.attn.qkv_proj.scales, c.attn.qkv_proj.scales)
                  for a, c in zip(ref.layers, rounded.layers))
    assert differs  # the source matters: bf16 weights would give other scales
    with pytest.raises(ValueError, match="float32 model on the CPU"):
        quantize_model(build_model(TINY, w, cpu, torch.bfloat16), "q4")


def _engine(scheme, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_engine(EngineConfig(engine="paged", device="cpu", dtype="float32", max_model_len=64,
                                         quantization=scheme, **kw), model_config=TINY, tokenizer=None)


@pytest.mark.parametrize("scheme", ["int8", "q4"])
def test_the_engine_on_the_triton_path_gives_the_cpu_kernels_tokens(scheme, monkeypatch):
    """Every quantized layer (projections and head) through ``forward_triton``, interpreted:
    greedy tokens identical to the C++ kernels' (sums in another order, the same argmax here),
    requests alone and batched."""
    prompts = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26]]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    cpu_eng = _engine(scheme, max_num_seqs=2)
    want = [o.token_ids for o in cpu_eng.run([cpu_eng.make_request(p, greedy) for p in prompts])]
    calls = []
    triton_forward = QuantizedLinear.forward_triton

    def counted(self, x):
        calls.append(self.fmt)
        return triton_forward(self, x)

    monkeypatch.setattr(QuantizedLinear, "forward", counted)
    batched = _engine(scheme, max_num_seqs=2)
    got = [o.token_ids for o in batched.run([batched.make_request(p, greedy) for p in prompts])]
    alone = []
    for p in prompts:
        e = _engine(scheme, max_num_seqs=1)
        alone.append(e.run([e.make_request(p, greedy)])[0].token_ids)
    assert got == want and alone == want
    assert {"int8_group", "q4_group" if scheme == "q4" else "int8_group"} <= set(calls)


# ---------------------------------------------------------------- on a GPU (make gpu-check)

def _cuda_run(scheme: str, dtype: str, max_num_seqs: int, prompts, graphs: bool = False):
    cfg = EngineConfig(engine="paged", device="cuda", dtype=dtype, attention_backend="triton", max_model_len=128,
                       block_size=16, max_num_seqs=max_num_seqs, enable_chunked_prefill=True, quantization=scheme,
                       cuda_graphs=graphs)
    engine = build_engine(cfg, model_config=TINY, tokenizer=None)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return engine, [o.token_ids for o in engine.run([engine.make_request(p, params) for p in prompts])]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("scheme", ["int8", "q4"])
def test_quantized_engine_on_cuda_gives_each_request_its_tokens_alone(scheme, dtype):
    prompts = [[(7 * i + j) % TINY.vocab_size for j in range(3 + 5 * i)] for i in range(5)]
    engine, batched = _cuda_run(scheme, dtype, 8, prompts)
    layer = engine.model.layers[0].mlp.down_proj
    assert isinstance(layer, QuantizedLinear) and layer.qweight.is_cuda and layer.scales.dtype == torch.float32
    alone = [_cuda_run(scheme, dtype, 1, [p])[1][0] for p in prompts]
    assert batched == alone
    _, graphed = _cuda_run(scheme, dtype, 8, prompts, graphs=True)
    assert graphed == batched
