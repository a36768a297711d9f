"""Cutting one model into N: which rank holds which slice of every layer (Megatron-style).

A decoder layer has two blocks, and each is split the same way:

* the first projection is **column-parallel**: rank r keeps a slice of its *output*
  features (attention: whole query heads with their K/V heads; MLP: a slice of the gate
  and of the up columns), so it computes its slice of the activations from the full input
  with no communication;
* the second projection is **row-parallel**: rank r keeps the matching slice of its
  *input* features, so its product is a partial sum of the full output, and one
  all-reduce (sum over ranks) makes every rank hold the full output again.

Two all-reduces a layer, of ``tokens x hidden`` each; everything between them (RoPE,
attention, SwiGLU) is local to a rank's heads or columns. The embeddings, norms and the LM
head are replicated (every rank holds them whole).

Heads are split by KV group (a group: one K/V head and the query heads that read it), as
evenly as they go: SmolLM2-135M has 3 groups of 3 query heads, so two ranks hold 2 and 1
groups (6 and 3 query heads) and the first does two thirds of the attention. The MLP's
1,536 columns split evenly for N = 2, 3, 4.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch
import torch.nn.functional as F

from .. import seams
from ..config import ModelConfig


def split_sizes(n: int, world_size: int) -> list[int]:
    """``n`` units over ``world_size`` ranks, as evenly as they go: the first ``n % world_size``
    ranks get one more. Every rank gets at least one, else ValueError."""
    if world_size < 1 or n < world_size:
        raise ValueError(f"cannot split {n} units over {world_size} ranks: every rank needs at least one")
    base, extra = divmod(n, world_size)
    return [base + (r < extra) for r in range(world_size)]


def shard_linear(weight: torch.Tensor, sizes: list[int], rank: int, parallel: str) -> torch.Tensor:
    """Rank ``rank``'s slice of an ``nn.Linear`` weight [out_features, in_features].

    ``sizes``: the consecutive pieces the split dimension is cut into, one per rank (they
    need not be equal). ``parallel="column"`` keeps this rank's output features (rows of
    the weight), ``"row"`` its input features (columns). A contiguous copy: the slice does
    not keep the whole matrix alive.
    """
    if parallel not in ("column", "row"):
        raise ValueError(f"parallel must be 'column' (split output features) or 'row' (input features), "
                         f"got {parallel!r}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}")
    if any(s < 0 for s in sizes):
        raise ValueError(f"sizes must be non-negative, got {sizes}")
    if not 0 <= rank < len(sizes):
        raise ValueError(f"rank must be in [0, {len(sizes)}) (one size per rank), got {rank}")
    dim = 0 if parallel == "column" else 1
    if sum(sizes) != weight.shape[dim]:
        raise ValueError(f"sizes {sizes} sum to {sum(sizes)}, but a {parallel}-parallel split cuts dimension "
                         f"{dim} of length {weight.shape[dim]}")
    start = sum(sizes[:rank])
    return weight.narrow(dim, start, sizes[rank]).clone(memory_format=torch.contiguous_format)  # one copy


def parallel_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                 all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """One rank's share of the SwiGLU MLP, and the one all-reduce that completes it.

    x [T, hidden] (the same on every rank); gate_up [2 * I_r, hidden]: this rank's gate
    rows, then its up rows (column-parallel); down [hidden, I_r] (row-parallel). The
    product of ``down`` is this rank's partial sum of the output; ``all_reduce`` sums the
    partial sums of all ranks, so every rank returns the full [T, hidden].
    """
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)  # [T, I_r] each: local, no communication
    return all_reduce(F.linear(F.silu(gate) * up, down))  # [T, hidden], summed over ranks


def allreduce_bytes_per_step(num_layers: int, hidden_size: int, num_tokens: int, dtype_bytes: int) -> int:
    """Bytes each rank all-reduces in one forward: two all-reduces a layer (attention's
    output projection, the MLP's down projection), each of ``num_tokens x hidden_size``."""
    for name, v in (("num_layers", num_layers), ("hidden_size", hidden_size), ("num_tokens", num_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
    if isinstance(dtype_bytes, bool) or not isinstance(dtype_bytes, int) or dtype_bytes not in (1, 2, 4, 8):
        raise ValueError(f"dtype_bytes must be 1, 2, 4 or 8, got {dtype_bytes!r}")
    return 2 * num_layers * hidden_size * num_tokens * dtype_bytes


def check_tensor_parallel(cfg: ModelConfig, world_size: int) -> None:
    """ValueError, saying what to change, where ``cfg`` cannot be split over ``world_size`` ranks."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {world_size!r}")
    if world_size > cfg.num_kv_heads:
        raise ValueError(f"tensor_parallel_size={world_size} is more than the model's {cfg.num_kv_heads} KV heads: "
                         f"heads are split by KV group, so use at most {cfg.num_kv_heads}")
    if cfg.intermediate_size < world_size:
        raise ValueError(f"tensor_parallel_size={world_size} is more than the MLP's {cfg.intermediate_size} columns")


def local_config(cfg: ModelConfig, world_size: int, rank: int) -> ModelConfig:
    """The model config of rank ``rank``'s shard: its heads and MLP columns."""
    check_tensor_parallel(cfg, world_size)
    groups = split_sizes(cfg.num_kv_heads, world_size)[rank]
    per_group = cfg.num_heads // cfg.num_kv_heads
    return replace(cfg, num_heads=groups * per_group, num_kv_heads=groups,
                   intermediate_size=split_sizes(cfg.intermediate_size, world_size)[rank])


def _checked_shard(mine: Callable) -> Callable:
    """A learner's ``shard_linear`` (the seam), each slice checked before a rank keeps it: the
    shape and dtype the contract gives, and a contiguous copy with storage of its own (a view
    would keep, and send to a worker, the whole matrix). A ``seams.SeamContractError`` otherwise."""

    def shard(weight: torch.Tensor, sizes: list[int], rank: int, parallel: str) -> torch.Tensor:
        got = mine(weight, sizes, rank, parallel)
        want = (sizes[rank], weight.shape[1]) if parallel == "column" else (weight.shape[0], sizes[rank])
        what = f"rank {rank} of sizes {sizes}, a weight {list(weight.shape)} cut {parallel}-parallel"
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != want or got.dtype != weight.dtype:
            shown = f"{got.dtype} {list(got.shape)}" if isinstance(got, torch.Tensor) else type(got).__name__
            raise seams.SeamContractError("shard_linear", f"the slice of {what} is {weight.dtype} {list(want)}",
                                          shown)
        held = got.untyped_storage().nbytes()
        if not got.is_contiguous() or held != got.numel() * got.element_size():
            raise seams.SeamContractError(
                "shard_linear", f"the slice of {what} is a contiguous copy with storage of its own",
                f"{'a contiguous' if got.is_contiguous() else 'a non-contiguous'} tensor over {held} bytes of "
                f"storage for its {got.numel() * got.element_size()}")
        return got

    return shard


def shard_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor], world_size: int,
                  rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s weights: its slices of every projection (through the seam
    ``shard_linear``), and the replicated embeddings, norms and head as they are."""
    mine = seams.plugged("shard_linear")
    shard = shard_linear if mine is None else _checked_shard(mine)
    check_tensor_parallel(cfg, world_size)
    per_group, D = cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    groups = split_sizes(cfg.num_kv_heads, world_size)
    q_sizes = [g * per_group * D for g in groups]
    kv_sizes = [g * D for g in groups]
    cols = split_sizes(cfg.intermediate_size, world_size)
    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if name.endswith("attn.qkv_proj.weight"):
            q, k, v = w.split([cfg.q_size, cfg.kv_size, cfg.kv_size])
            out[name] = torch.cat([shard(q, q_sizes, rank, "column"), shard(k, kv_sizes, rank, "column"),
                                   shard(v, kv_sizes, rank, "column")])
        elif name.endswith("attn.o_proj.weight"):
            out[name] = shard(w, q_sizes, rank, "row")
        elif name.endswith("mlp.gate_up_proj.weight"):
            gate, up = w.chunk(2)
            out[name] = torch.cat([shard(gate, cols, rank, "column"), shard(up, cols, rank, "column")])
        elif name.endswith("mlp.down_proj.weight"):
            out[name] = shard(w, cols, rank, "row")
        else:
            out[name] = w  # embeddings, norms, head: every rank holds them whole
    return out
