"""Chapter 11's edges: a model quantized in 4-bit and in 8-bit groups, with a constant group, a
vocabulary that does not fill the last block of output columns, and the layers' own groups.

A tiny random model, quantized by the engine (``LLM(quantization=...)``): what each projection
keeps (codes, scales, minimums), the top-3 tokens at every position of a teacher-forced prompt,
and greedy tokens. With a learner's Triton GEMV plugged in, every 8-bit layer runs in Triton's
interpreter: the 8-bit engine generates only a few tokens.
"""
from __future__ import annotations

from functools import partial
from typing import Any

import torch

from minillm.config import ModelConfig

from . import EdgeCase

# Output columns: qkv 128, o 64, gate_up 192, down 64, and the head's 120 (not a multiple of 64:
# the last block of outputs is partial). Every K (64, 96) is whole groups of 32.
TINY = ModelConfig(vocab_size=120, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16, max_position_embeddings=64)
PROMPTS = [[1, 5, 9, 13, 7, 3], [1, 22, 33, 44, 101, 87, 2, 119, 64]]
TEACHER_FORCED = [1, 17, 4, 90, 33, 2, 61, 8, 119, 45, 7, 77, 12, 5, 99, 31]
CONSTANT = 0.25  # the value of the constant groups


def random_weights(cfg: ModelConfig, seed: int, std: float = 0.2) -> dict[str, torch.Tensor]:
    """Weights of ``cfg`` drawn at ``std`` (norms at 1), with constant groups of 32 in two projections:
    where max == min, the contract's scale is 1.0 and every code 0."""
    from minillm.model import Llama

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Llama(cfg).state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    weights = {k: (torch.ones(s) if "norm" in k else torch.randn(s, generator=g) * std) for k, s in shapes.items()}
    weights["layers.0.mlp.down_proj.weight"][3, 32:64] = CONSTANT
    weights["layers.1.attn.qkv_proj.weight"][:2, :32] = -CONSTANT
    return weights


def quantized(scheme: str, max_tokens: int) -> dict[str, Any]:
    """``LLM(quantization=scheme)`` on the tiny model: what each projection keeps, the top-3 tokens
    at every position of a teacher-forced prompt, two requests' greedy tokens."""
    import warnings

    from minillm import SamplingParams
    from minillm.config import EngineConfig
    from minillm.engine import build_engine
    from minillm.model_runner import prompt_logits
    from minillm.quantization import QuantizedLinear

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = build_engine(EngineConfig(engine="paged", device="cpu", dtype="float32", max_model_len=64,
                                           block_size=8, quantization=scheme, attention_backend="cpu"),
                              weights=random_weights(TINY, seed=0), tokenizer=None, model_config=TINY)
    layers = {name: {"codes": m.qweight.tolist(), "scales": m.scales.tolist(), "mins": m.mins.tolist()}
              for name, m in engine.model.named_modules() if isinstance(m, QuantizedLinear) and "head" not in name}
    with torch.inference_mode():
        ranking = prompt_logits(engine.model, TEACHER_FORCED).topk(3, dim=-1).indices.tolist()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    tokens = [o.token_ids for o in engine.run([engine.make_request(p, params) for p in PROMPTS])]
    return {"each projection's groups": layers, "top-3 tokens at every position of a prompt": ranking,
            "tokens": tokens}


CASES = [
    # 4-bit codes (at most 15) in groups with a constant one; every 4-bit layer's weight dequantized.
    EdgeCase("a 4-bit model with constant groups: the groups kept, and the model's tokens",
             ("quantize_groups", "dequantize_groups"), partial(quantized, "q4", 6)),
    # 8-bit codes; the head's 120 output columns leave the last block of 64 partial; every 8-bit
    # layer (the head too) multiplied by the plugged GEMV.
    EdgeCase("an 8-bit model whose head ends in a partial block of outputs: the groups kept, and the tokens",
             ("quantize_groups", "dequantize_groups", "int8_gemv_triton"), partial(quantized, "int8", 3)),
]
