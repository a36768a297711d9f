"""Chapter 0's edges: the norm, RoPE and sampler inside a tiny random Llama's forward and steps.

The model is SmolLM2's architecture shrunk to 64 tokens, 32 dimensions and 3 layers, with
seeded random weights, so a whole run takes milliseconds. Both runs of a case take the
``torch`` attention backend: the ``cpu`` backend's fused layer ops step aside while a norm
or RoPE is plugged, and would differ from the plain layer loop by float rounding.

A correct sampler need not draw as the library does (``torch.multinomial`` samples the same
distribution, other tokens), so the sampling case compares only what every correct sampler
decides alike: greedy rows, rows whose filter leaves a single token, and that a seeded
request repeats its tokens. The engine checks each sampled token against the filter itself.
"""
from __future__ import annotations

from functools import partial

import torch

from . import EdgeCase

V, D = 64, 32


def _config(**overrides):
    from minillm.config import ModelConfig

    return ModelConfig(**(dict(vocab_size=V, hidden_size=D, intermediate_size=64, num_layers=3, num_heads=4,
                                num_kv_heads=2, head_dim=8, max_position_embeddings=256, eos_token_id=2)
                           | overrides))


def _random_weights(cfg, embed_scale: float = 1.0, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded random weights: projections scaled up so the text varies, norm weights around 1
    (not all ones, so a norm that forgets its weight shows), embeddings scaled by ``embed_scale``."""
    from minillm import loader

    g = torch.Generator().manual_seed(seed + 1)
    out = {}
    for name, w in loader.dummy_weights(cfg, seed).items():
        if "norm" in name:
            out[name] = 1 + 0.3 * torch.randn(w.shape, generator=g)
        elif name == "embed.weight":
            out[name] = w * 10 * embed_scale
        else:
            out[name] = w * 10
    return out


def _fixed_distribution_weights(cfg, logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """Weights whose forward gives ``logits`` [V] at every position: the layers add nothing
    (their projections are zero), every token embeds to the same all-ones vector (its RMS norm
    is itself), and the untied head's row v sums to logits[v]."""
    w = {name: torch.zeros_like(t) for name, t in _random_weights(cfg).items()}
    w.update({name: torch.ones(cfg.hidden_size) for name in w if "norm" in name})
    w["embed.weight"] = torch.ones(cfg.vocab_size, cfg.hidden_size)
    w["lm_head.weight"] = (logits / cfg.hidden_size)[:, None].expand(-1, cfg.hidden_size).contiguous()
    return w


def _engine(cfg, weights, dtype: str = "float32"):
    from minillm.config import EngineConfig
    from minillm.engine import build_engine

    config = EngineConfig(engine="paged", device="cpu", dtype=dtype, max_model_len=128, block_size=4,
                          max_num_seqs=4, attention_backend="torch")
    return build_engine(config, weights=weights, tokenizer=None, model_config=cfg)


def _prompts(lens: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, V, (n,), generator=g).tolist() for n in lens]


def _run(engine, prompts, params) -> list[list[int]]:
    with torch.inference_mode():
        return [o.token_ids for o in engine.run([engine.make_request(p, sp) for p, sp in zip(prompts, params)])]


def _greedy(n: int):
    from minillm.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def greedy_text(dtype: str = "float32", embed_scale: float = 1.0, prompt_lens=(1, 5, 12, 7),
                max_tokens: int = 8) -> dict:
    """Greedy tokens of a batch of prompts (prefills of several tokens, then decodes)."""
    cfg = _config()
    one_thread = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: no thread pool to wait on
    try:
        eng = _engine(cfg, _random_weights(cfg, embed_scale), dtype)
        return {"tokens": _run(eng, _prompts(list(prompt_lens)), [_greedy(max_tokens)] * len(prompt_lens))}
    finally:
        torch.set_num_threads(one_thread)


# The fixed next-token distribution of the sampling case: .40, .25, .15, .08, then a flat tail.
_PROBS = torch.tensor([0.40, 0.25, 0.15, 0.08] + [0.12 / (V - 4)] * (V - 4))
_ORDER = torch.randperm(V, generator=torch.Generator().manual_seed(5))  # the likeliest token is not token 0


def sampling(max_tokens: int = 8) -> dict:
    """The engine's sampler on a fixed distribution, where every correct sampler decides alike."""
    from minillm.sampling_params import SamplingParams

    cfg = _config(tie_word_embeddings=False)
    logits = torch.empty(V).scatter_(0, _ORDER, _PROBS.log())
    one_thread = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        eng = _engine(cfg, _fixed_distribution_weights(cfg, logits))
        decided = [
            _greedy(max_tokens),
            # a hot sampler with a single candidate: top_k 1 leaves only the argmax
            SamplingParams(temperature=2.0, top_k=1, max_tokens=max_tokens, ignore_eos=True, seed=1),
            # at temperature .5 the likeliest token holds .62 > top_p .55 (at temperature 1 only .40):
            # the nucleus is that one token once the temperature is applied first
            SamplingParams(temperature=0.5, top_p=0.55, max_tokens=max_tokens, ignore_eos=True, seed=2),
        ]
        # Wide rows (the filter keeps several tokens): their tokens are the draw's, but the same
        # seed must give the same tokens in a second run.
        wide = [SamplingParams(temperature=1.0, top_k=3, max_tokens=max_tokens, ignore_eos=True, seed=3),
                SamplingParams(temperature=1.3, top_p=0.9, max_tokens=max_tokens, ignore_eos=True, seed=4)]
        prompts = _prompts([3, 6, 2, 5, 4], seed=1)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # a sampler that draws from the global generator, deterministically
            first = _run(eng, prompts, decided + wide)
            again = _run(eng, prompts[3:], wide)
        return {"greedy and single-candidate rows": first[:3],
                "wide rows, run twice with the same seeds: the same tokens": first[3:] == again}
    finally:
        torch.set_num_threads(one_thread)


CASES = [
    # A one-token prompt, prompts that prefill several rows at once (a norm over the wrong dim
    # mixes them), decodes; norm weights that are not all ones; greedy rows through the sampler.
    EdgeCase("prompts of 1 to 12 tokens, greedy: every norm and rotation of prefill and decode rows",
             ("rms_norm", "apply_rope", "sample_next_token"), greedy_text),
    # float16, with a residual stream of magnitude ~1000: x ** 2 overflows float16 (max 65504)
    # unless the norm squares in float32; a norm or RoPE that answers in float32 breaks the layout.
    EdgeCase("float16 activations whose squares overflow float16",
             ("rms_norm", "apply_rope"), partial(greedy_text, "float16", embed_scale=5000.0)),
    # Embeddings of RMS ~ 1e-3, at the scale of sqrt(eps) = 3e-3: where eps sits in the formula
    # changes the first layer's normalized input by tens of percent.
    EdgeCase("activations at the scale of sqrt(eps): where eps sits matters",
             ("rms_norm",), partial(greedy_text, embed_scale=0.005)),
    EdgeCase("seeded sampling: a single candidate at temperature 2, a nucleus the temperature makes single, "
             "seeds that repeat", ("sample_next_token",), sampling),
]
