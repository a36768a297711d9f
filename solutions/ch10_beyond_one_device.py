"""Chapter 10 solutions: same names and signatures as ``exercises/ch10_beyond_one_device.py``.

The slicing, the rank's MLP and the bytes formula are ``minillm/distributed/sharding.py``'s
``shard_linear``, ``parallel_mlp`` and ``allreduce_bytes_per_step``: the ones the engine's
tensor-parallel workers and runner use.
"""
from __future__ import annotations

from typing import Callable

import torch

from minillm.distributed import sharding
from minillm.course import quiz


def shard_linear(weight: torch.Tensor, sizes: list[int], rank: int, parallel: str) -> torch.Tensor:
    """``sharding.shard_linear``: rows (column-parallel) or columns (row-parallel)
    ``start .. start + sizes[rank]``, copied, after checking every argument."""
    return sharding.shard_linear(weight, list(sizes), rank, parallel)


def parallel_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                 all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``sharding.parallel_mlp``: gate/up column-parallel, SiLU and product on this rank's
    features, down row-parallel, then one all-reduce of the partial sums."""
    return sharding.parallel_mlp(x, gate_up, down, all_reduce)


def allreduce_bytes_per_step(num_layers: int, hidden_size: int, num_tokens: int, dtype_bytes: int) -> int:
    """``sharding.allreduce_bytes_per_step``: two all-reduces a layer, each num_tokens x hidden_size."""
    if isinstance(dtype_bytes, bool) or not isinstance(dtype_bytes, int):
        raise ValueError(f"dtype_bytes must be an int, 1, 2, 4 or 8, got {dtype_bytes!r}")
    return sharding.allreduce_bytes_per_step(num_layers, hidden_size, num_tokens, dtype_bytes)


def quiz_answers() -> dict[str, str | float]:
    """The reference answers, kept as digests like the questions' own (``quiz.sealed``): ``make grade`` says whether
    yours is right. How to work them out: q1: the all-reduced activations of each layer's two all-reduces, for
    every token, in bfloat16; count what one rank sends."""
    return quiz.sealed("ch10")
