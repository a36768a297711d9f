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
            return mine(x, _dense(self.gate_up_proj), _dense(self.down_proj.linear), self.comm.all_reduce)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # sharding.parallel_mlp's math, on the (packed) modules
        return self.down_proj(F.silu(gate) * up)


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

