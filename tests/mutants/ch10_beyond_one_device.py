"""Wrong answers to exercises/ch10_beyond_one_device.py, each a mistake the contract rules out."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mutants import mutant


def _check_shard_args(weight, sizes, rank, parallel, dim):
    if parallel not in ("column", "row"):
        raise ValueError(f"parallel must be 'column' or 'row', got {parallel!r}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D, got {tuple(weight.shape)}")
    if any(s < 0 for s in sizes) or sum(sizes) != weight.shape[dim]:
        raise ValueError(f"sizes {sizes} do not cut dimension {dim} of {tuple(weight.shape)}")
    if not 0 <= rank < len(sizes):
        raise ValueError(f"rank {rank} outside [0, {len(sizes)})")


# ---------------------------------------------------------------- shard_linear


@mutant("shard_linear", "a rank's piece starts at rank * sizes[rank], as if every piece were the same size")
def _start_as_if_equal(weight, sizes, rank, parallel):
    dim = 0 if parallel == "column" else 1
    _check_shard_args(weight, sizes, rank, parallel, dim)
    start = rank * sizes[rank]
    return weight.narrow(dim, start, sizes[rank]).clone()


@mutant("shard_linear", "the slice is not copied: .contiguous() of a slice of rows is a view of the whole matrix")
def _view_not_copy(weight, sizes, rank, parallel):
    dim = 0 if parallel == "column" else 1
    _check_shard_args(weight, sizes, rank, parallel, dim)
    start = sum(sizes[:rank])
    return weight.narrow(dim, start, sizes[rank]).contiguous()


@mutant("shard_linear", "column and row are swapped: column-parallel cuts the input features (columns)")
def _column_row_swapped(weight, sizes, rank, parallel):
    dim = 1 if parallel == "column" else 0
    _check_shard_args(weight, sizes, rank, parallel, dim)
    start = sum(sizes[:rank])
    return weight.narrow(dim, start, sizes[rank]).clone()


@mutant("shard_linear", "a rank outside [0, len(sizes)) is not refused (rank -1 quietly gets the last piece)",
        same_in_engine="the engine cuts shards for ranks 0 .. N - 1 only (shard_weights, one call per rank)")
def _rank_not_checked(weight, sizes, rank, parallel):
    dim = 0 if parallel == "column" else 1
    _check_shard_args(weight, sizes, rank % len(sizes) if sizes else rank, parallel, dim)
    start = sum(sizes[:rank])
    return weight.narrow(dim, start, sizes[rank]).clone()


# ---------------------------------------------------------------- parallel_mlp


@mutant("parallel_mlp", "the all-reduce comes right after gate_up, adding different ranks' features together")
def _all_reduce_after_gate_up(x, gate_up, down, all_reduce):
    gate, up = all_reduce(F.linear(x, gate_up)).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


@mutant("parallel_mlp", "the partial output is all-reduced twice")
def _all_reduce_twice(x, gate_up, down, all_reduce):
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return all_reduce(all_reduce(F.linear(F.silu(gate) * up, down)))


@mutant("parallel_mlp", "all_reduce is called, but the rank returns its own partial sum, not what all_reduce returns")
def _ignores_the_sum(x, gate_up, down, all_reduce):
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    partial = F.linear(F.silu(gate) * up, down)
    all_reduce(partial)
    return partial


@mutant("parallel_mlp", "gate and up are swapped: SiLU goes on the up rows (the second half of gate_up)")
def _gate_up_swapped(x, gate_up, down, all_reduce):
    up, gate = F.linear(x, gate_up).chunk(2, dim=-1)
    return all_reduce(F.linear(F.silu(gate) * up, down))


# ---------------------------------------------------------------- allreduce_bytes_per_step


def _check_bytes_args(num_layers, hidden_size, num_tokens, dtype_bytes):
    for v in (num_layers, hidden_size, num_tokens):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"need a non-negative int, got {v!r}")
    if isinstance(dtype_bytes, bool) or not isinstance(dtype_bytes, int) or dtype_bytes not in (1, 2, 4, 8):
        raise ValueError(f"dtype_bytes must be 1, 2, 4 or 8, got {dtype_bytes!r}")


@mutant("allreduce_bytes_per_step", "one all-reduce a layer (the one after attention is forgotten)")
def _one_all_reduce_a_layer(num_layers, hidden_size, num_tokens, dtype_bytes):
    _check_bytes_args(num_layers, hidden_size, num_tokens, dtype_bytes)
    return num_layers * hidden_size * num_tokens * dtype_bytes


@mutant("allreduce_bytes_per_step", "the number of tokens is left out (the bytes of one token's all-reduces)")
def _tokens_left_out(num_layers, hidden_size, num_tokens, dtype_bytes):
    _check_bytes_args(num_layers, hidden_size, num_tokens, dtype_bytes)
    return 2 * num_layers * hidden_size * dtype_bytes


@mutant("allreduce_bytes_per_step", "the bytes come back as a float (2.0 * ...), not an int")
def _a_float(num_layers, hidden_size, num_tokens, dtype_bytes):
    _check_bytes_args(num_layers, hidden_size, num_tokens, dtype_bytes)
    return 2.0 * num_layers * hidden_size * num_tokens * dtype_bytes


@mutant("allreduce_bytes_per_step", "a bool is taken for an int (True counts as 1 token)",
        same_in_engine="the runner passes len(input_ids) and a tensor's element_size(): ints, never bools")
def _bool_taken(num_layers, hidden_size, num_tokens, dtype_bytes):
    for v in (num_layers, hidden_size, num_tokens):
        if not isinstance(v, int) or v < 0:
            raise ValueError(f"need a non-negative int, got {v!r}")
    if not isinstance(dtype_bytes, int) or dtype_bytes not in (1, 2, 4, 8):
        raise ValueError(f"dtype_bytes must be 1, 2, 4 or 8, got {dtype_bytes!r}")
    return 2 * num_layers * hidden_size * num_tokens * dtype_bytes
