"""Placement on the GPUs learners have: bf16 where the card computes it, float16 where it does not
(Colab's T4), a clear error on a card older than the kernels' oldest target. The GPU is faked
(its capability and name), so these run on the CPU; the float16 model runs on the CPU too."""
from __future__ import annotations

import pytest
import torch

from minillm import placement


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA device of the given capability, as far as placement asks."""

    def install(capability: tuple[int, int], name: str):
        monkeypatch.setattr(placement, "cuda_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)

    return install


@pytest.mark.parametrize("capability, name, dtype", [((7, 5), "Tesla T4", torch.float16),
                                                     ((8, 0), "A100-SXM4-80GB", torch.bfloat16),
                                                     ((8, 6), "NVIDIA GeForce RTX 3090", torch.bfloat16),
                                                     ((8, 9), "NVIDIA L4", torch.bfloat16),
                                                     ((9, 0), "NVIDIA H100", torch.bfloat16)])
def test_the_default_dtype_is_bf16_where_the_gpu_has_it_else_float16(fake_gpu, capability, name, dtype):
    fake_gpu(capability, name)
    place = placement.resolve(device="cuda")
    assert (place.device.type, place.dtype, place.attention_backend) == ("cuda", dtype, "triton")


def test_bf16_asked_for_on_a_t4_is_a_clear_error_naming_float16(fake_gpu):
    fake_gpu((7, 5), "Tesla T4")
    with pytest.raises(ValueError, match=r"Tesla T4 \(sm_75\), which has no bfloat16.*dtype='float16'"):
        placement.resolve(device="cuda", dtype="bfloat16")
    assert placement.resolve(device="cuda", dtype="float32").dtype == torch.float32


@pytest.mark.parametrize("capability", [(6, 1), (7, 0)])
def test_a_gpu_older_than_turing_is_a_clear_error(fake_gpu, capability):
    fake_gpu(capability, "Tesla V100" if capability == (7, 0) else "GeForce GTX 1080")
    with pytest.raises(ValueError, match=rf"sm_{capability[0]}{capability[1]}; .*sm_75 .*device='cpu'"):
        placement.resolve(device="cuda")


@pytest.mark.slow
def test_smollm2_in_float16_stays_finite_and_greedy_agrees_with_float32():
    """What the float16 default on a T4 rests on: SmolLM2's hidden states stay below half of
    float16's largest value (65,504) in every layer, and its greedy choices are float32's. They
    come closer than one might think: layer 11's MLP writes a single value of about 23,700 into
    the residual stream (a "massive activation"), 36% of the range."""
    from minillm import loader
    from minillm.model import build_model
    from minillm.model_runner import prompt_logits

    from prompts import long_prompt

    cfg, weights = loader.read_config(), loader.load_weights()
    prompt = long_prompt(loader.load_tokenizer(), 200)[:200]
    peaks: list[float] = []

    def peak(module, args, output):
        out = output[0] if isinstance(output, tuple) else output
        assert torch.isfinite(out).all(), f"{type(module).__name__} produced inf or NaN in float16"
        peaks.append(float(out.abs().max()))

    logits = {}
    for dtype in (torch.float32, torch.float16):
        model = build_model(cfg, weights, torch.device("cpu"), dtype, "torch")
        hooks = [layer.register_forward_hook(peak) for layer in model.layers] if dtype == torch.float16 else []
        logits[dtype] = prompt_logits(model, prompt).float()
        for h in hooks:
            h.remove()
    assert max(peaks) < 65504 / 2, f"a hidden state reached {max(peaks):.0f} in float16 (largest 65,504)"
    agree = (logits[torch.float16].argmax(-1) == logits[torch.float32].argmax(-1)).float().mean().item()
    assert agree >= 0.95, f"float16 picks float32's token at {agree:.0%} of the positions"
