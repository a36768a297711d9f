"""Chapter 0 solutions: same names and signatures as ``exercises/ch00_the_model.py``.

Most answers are the code ``minillm`` itself runs; each wrapper says where to read it.
"""
from __future__ import annotations

from typing import Callable

import torch

from minillm import model, sampling
from minillm.course import quiz


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Read ``minillm/model.py``, ``rms_norm``: float32 statistics, cast back, then scale."""
    return model.rms_norm(x, weight, eps)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Read ``minillm/model.py``, ``rope_cos_sin``: the angle table, doubled along the last dim."""
    return model.rope_cos_sin(positions, head_dim, theta)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Read ``minillm/model.py``, ``apply_rope``: ``x * cos + rotate_half(x) * sin``."""
    return model.apply_rope(x, cos, sin)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Read ``minillm/sampling.py``, ``apply_top_k_top_p``: one sort, two masks, one scatter."""
    return sampling.apply_top_k_top_p(logits, top_k, top_p)


def sample_next_token(logits: torch.Tensor, temperature: float, top_k: int = -1, top_p: float = 1.0,
                      generator: torch.Generator | None = None) -> int:
    """Read ``minillm/sampling.py``: ``sample`` takes the argmax for greedy rows and draws
    nothing; other rows go through ``compute_probs`` and ``sample_from_probs``."""
    params = sampling.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    return int(sampling.sample(logits[None], [params], [generator])[0])  # a batch of one row


def decode_bytes_per_token(num_params: int, bytes_per_param: float, kv_bytes_per_token: int,
                           context_len: int, batch_size: int) -> float:
    """Weights once per step (shared by the batch) plus each sequence's KV, per token produced.

    ``minillm.ModelConfig.num_params()`` and ``kv_bytes_per_token(dtype_bytes)`` give the
    inputs for a real model.
    """
    weight_bytes = num_params * bytes_per_param  # read once per step, whatever the batch
    kv_bytes = batch_size * context_len * kv_bytes_per_token  # every sequence reads its own past
    return (weight_bytes + kv_bytes) / batch_size


def greedy_generate(forward: Callable[[list[int], int], torch.Tensor], prompt_ids: list[int],
                    max_new_tokens: int, eos_token_id: int) -> list[int]:
    """The loop of the chapter's ``naive_generate``: the prompt once, then one token per call."""
    out: list[int] = []
    fed, feed = 0, list(prompt_ids)
    while len(out) < max_new_tokens:
        logits = forward(feed, fed)
        fed += len(feed)
        token = int(logits[-1].argmax())
        out.append(token)
        if token == eos_token_id:
            break
        feed = [token]
    return out


def quiz_answers() -> dict[str, str | float]:
    """The reference answers, kept as digests like the questions' own (``quiz.sealed``): ``make grade`` says whether
    yours is right. How to work them out: q1: the weights' bytes over the read bandwidth; q3: K and V, in every
    layer, for every KV head, head_dim values of 2 bytes."""
    return quiz.sealed("ch00")
