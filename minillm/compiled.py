"""The step's forward as one compiled graph: ``LLM(compile=True)`` on the CPU.

Eager PyTorch dispatches every op from Python: a decode step of SmolLM2 runs about
1,400 of them (30 layers of norms, projections, RoPE, SwiGLU, residual adds), and at a
few rows each costs more to dispatch than to compute. ``torch.compile`` traces
``Llama.forward`` once into a graph, and its inductor backend fuses the elementwise work
between the matmuls into a few generated C++ loops per layer; the step then makes one
call into the graph instead of a thousand into PyTorch.

Two things stay opaque to the compiler, as custom ops:

- **attention, with its KV write** (``minillm::attention``). The torch backend plans
  each step on the host from the step's metadata (Python lists of lengths and block
  tables), which a graph cannot hold. The op takes the layer's index and finds the
  step's metadata and that layer's cache in a context set around the call; vLLM's
  compiled models do the same (``vllm/attention/layer.py``: attention is a registered
  custom op that reads the step from ``get_forward_context()``). Inside the op runs
  exactly the eager attention.
- **oneDNN's packed linear** (``minillm::packed_linear``): inductor lowers that op only
  for the weights it packs itself.

What the graph computes is the eager forward with its elementwise ops fused, so the
numbers differ by float rounding (inductor sums a row's RMSNorm in another order):
greedy tokens are the same as eager's as long as no two logits are that close, and the
graph is one graph for every number of tokens, so a request decodes the same tokens
alone as in any batch (tests/test_compiled.py).

The first step compiles (about a minute for SmolLM2 on two cores; inductor keeps the
kernels it generated in its disk cache, so a later process compiles faster). torch
guards a graph on the CPU thread count, and a step at another count compiles again,
so a compiled engine keeps one count: ``cpu_threads="auto"`` does not move it with the
load of other programs (threads.py) as it does for eager steps; an integer fixes it. CPU and the
torch attention backend only: on CUDA, ``cuda_graphs=True`` removes the same overhead.

While a learner's function is plugged into a seam of the forward (``model.FORWARD_SEAMS``:
chapter 0's norm and RoPE, chapter 3's K/V store), a step runs the eager forward, which
calls it; the graph never holds a learner's code.
"""
from __future__ import annotations

from typing import Any

import torch

from . import model
from .attention import write_and_attend

_STEP: dict[str, Any] = {}  # the running step's metadata, caches and backend (CompiledForward.__call__)


@torch.library.custom_op("minillm::attention", mutates_args=())
def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
    """This step's K, V into layer ``layer``'s cache, then attention over it: the eager path."""
    return write_and_attend(_STEP["backend"], q, k, v, _STEP["kv_caches"][layer], _STEP["meta"], scale)


@_attention.register_fake
def _(q, k, v, layer, scale):
    return torch.empty_like(q)


@torch.library.custom_op("minillm::packed_linear", mutates_args=())
def _packed_linear(x: torch.Tensor, weight: torch.Tensor, out_features: int) -> torch.Tensor:
    return model._packed_linear(x, weight)


@_packed_linear.register_fake
def _(x, weight, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


def check_compile(device: torch.device, attention_backend: str) -> None:
    """ValueError unless ``compile=True`` can run here."""
    if device.type != "cpu":
        raise ValueError(f"compile=True compiles the CPU step; this engine runs on {device}: on a GPU pass "
                         "cuda_graphs=True (with attention_backend='triton') instead, or compile=False")
    if attention_backend not in ("torch", "cpu"):
        raise ValueError(f"compile=True needs attention_backend='cpu' or 'torch' on the CPU, got {attention_backend!r}")
    import os
    import shutil

    if not (os.environ.get("CXX") or any(shutil.which(c) for c in ("g++", "c++", "clang++"))):
        raise ValueError("compile=True builds C++ kernels and needs a C++ compiler (g++ or clang++ on the PATH, "
                         "or CXX); install one, or pass compile=False")


class CompiledForward:
    """``model.forward`` compiled once, for every number of tokens; called like it."""

    def __init__(self, model):
        self.model = model
        # One graph whatever the number of tokens T, T = 1 included (a size that is
        # otherwise specialized): a decode step alone and in a batch run the same code.
        self._fn = torch.compile(model.forward, dynamic=True, fullgraph=True)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, kv_caches) -> torch.Tensor:
        if model.forward_seam_plugged():  # a learner's norm, RoPE or K/V store: the eager forward calls it
            return self.model(input_ids, positions, meta, kv_caches)
        # Views of the step's one upload (model_runner.build_batch) start at offset T, which
        # the graph would specialize for T = 1 as for a size: it gets tensors of their own.
        input_ids, positions = input_ids.clone(), positions.clone()
        torch._dynamo.decorators.mark_unbacked(input_ids, 0)
        torch._dynamo.decorators.mark_unbacked(positions, 0)
        _STEP.update(meta=meta, kv_caches=kv_caches, backend=self.model._backend)
        try:
            return self._fn(input_ids, positions, None, None)
        finally:
            _STEP.clear()
