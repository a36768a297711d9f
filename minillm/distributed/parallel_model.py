"""One rank's model: a ``Llama`` of its heads and MLP columns, with the two all-reduces a
layer that make its output the unsplit model's (``sharding.py`` explains the split).

The rank's shard is a plain ``Llama`` built from ``sharding.local_config`` (fewer heads,
fewer MLP columns) and ``sharding.shard_weights``; two modules of every layer are then
wrapped so the layer's partial sums are summed over the ranks:

* ``attn.o_proj`` -> ``AllReduced``: the row-parallel output projection, then the sum;
* ``mlp`` -> ``ParallelMLP``: gate/up (column-parallel), SwiGLU, down (row-parallel),
  then the sum; through the seam ``parallel_mlp`` when a learner's function is plugged.

Both the plain layer loop and the cpu backend's fused path (``Llama._cpu_layers``) call
these modules, so every attention backend runs sharded unchanged.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from .. import seams
from ..config import ModelConfig
from ..model import Llama, build_model
from .group import Communicator
from .sharding import local_config


def _dense(linear: nn.Module) -> torch.Tensor:
    return linear.dense() if hasattr(linear, "dense") else linear.weight


class AllReduced(nn.Module):
    """A row-parallel projection: this rank's partial product, summed over the ranks."""

    def __init__(self, linear: nn.Module, comm: Communicator):
        super().__init__()
        self.linear = linear
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(self.linear(x))


class ParallelMLP(nn.Module):
    """The MLP of one rank. ``gate_up_proj`` and ``down_proj`` are what the cpu backend's
    fused layer calls (``down_proj`` all-reduces); ``forward`` is the seam ``parallel_mlp``."""

    def __init__(self, mlp: nn.Module, comm: Communicator):
        super().__init__()
        self.gate_up_proj = mlp.gate_up_proj
        self.down_proj = AllReduced(mlp.down_proj, comm)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mine = seams.plugged("parallel_mlp")
        if mine is not None:
            return plugged_mlp(mine, x, _dense(self.gate_up_proj), _dense(self.down_proj.linear), self.comm)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # sharding.parallel_mlp's math, on the (packed) modules
        return self.down_proj(F.silu(gate) * up)


def plugged_mlp(mine, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """A learner's ``parallel_mlp`` (the seam) on this rank, held to its contract before the layer
    goes on: one all-reduce, of the partial output [T, hidden], and the full [T, hidden] back in
    x's dtype. A second call or a tensor of another shape is refused before it reaches the other
    ranks (they run the same function and stop at the same place, so none waits in a collective
    for it). Its ``all_reduce`` sums a copy and returns it, as the contract allows: the argument
    keeps this rank's partial sum, so only what ``all_reduce`` returns is the whole output."""
    calls = []

    def broken(invariant: str, got: str) -> BaseException:
        error = seams.SeamContractError("parallel_mlp", invariant, f"{got} (rank {comm.rank})")
        if comm.rank == 0:
            return error
        # Rank 0 runs the same function and reports the same rule; a worker says it in one line and stops.
        print(error, file=sys.stderr)
        return SystemExit(1)

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        if calls:
            raise broken("exactly one all_reduce a call, after the down projection", "a second all_reduce")
        if not isinstance(t, torch.Tensor) or t.shape != x.shape:
            shown = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise broken(f"the all-reduced tensor is the rank's partial output [T, hidden] = {list(x.shape)}",
                         f"all_reduce of {shown}")
        calls.append(tuple(t.shape))
        return comm.all_reduce(t.clone())

    out = mine(x, gate_up, down, all_reduce)
    if not calls:
        raise broken("exactly one all_reduce a call, after the down projection", "no all_reduce")
    if not isinstance(out, torch.Tensor) or out.shape != x.shape or out.dtype != x.dtype:
        shown = f"{out.dtype} {list(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise broken(f"the output is the full MLP output, {x.dtype} {list(x.shape)}", shown)
    return out


def build_parallel_model(cfg: ModelConfig, shard: dict[str, torch.Tensor], comm: Communicator,
                         device: torch.device, dtype: torch.dtype, attention_backend: str,
                         pack_weights: bool) -> Llama:
    """Rank ``comm.rank``'s model from its ``shard`` of the weights."""
    model = build_model(local_config(cfg, comm.world_size, comm.rank), shard, device, dtype, attention_backend,
                        pack_weights)
    for layer in model.layers:
        layer.attn.o_proj = AllReduced(layer.attn.o_proj, comm)
        layer.mlp = ParallelMLP(layer.mlp, comm)
    return model

