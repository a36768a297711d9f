"""Seams: the places where a learner's function can take the place of the engine's own.

Each chapter's core mechanism is called through a seam with the exact signature of the
chapter's exercise. Nothing is plugged by default: the engine runs its own code, and the
check at each call site is one dictionary lookup. ``plug`` swaps implementations in for
the duration of a ``with`` block (a notebook cell, a capstone run, a test)::

    from minillm import seams
    with seams.plug(paged_decode_attention=my_attention):
        llm.generate(...)            # every decode row's attention is yours

``SEAMS`` lists every seam: the exercise it comes from and the library code it replaces.
A name that is not a seam, or a value that is not callable, is a ValueError, so a typo
cannot silently leave the library's code in place.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator


@dataclass(frozen=True)
class Seam:
    name: str  # the exercise function's name, which is also the seam's
    chapter: str  # exercises/<chapter>.py
    replaces: str  # the library code that runs when nothing is plugged


SEAMS: dict[str, Seam] = {s.name: s for s in [
    Seam("rms_norm", "ch00_the_model", "model.RMSNorm: every norm of the forward (the cpu backend's fused layer steps aside)"),
    Seam("apply_rope", "ch00_the_model", "model.Attention: rotating queries and keys by position"),
    Seam("sample_next_token", "ch00_the_model", "sampling.sample: the next token of each row"),
    Seam("static_schedule", "ch01_static_batching", "StaticScheduler.schedule: forming a group, decoding it out"),
    Seam("schedule_step", "ch02_continuous_batching", "ContinuousScheduler.schedule: decodes, then FCFS admission"),
    Seam("blocks_needed", "ch03_paged_attention", "block_manager.blocks_needed"),
    Seam("slot_mapping", "ch03_paged_attention", "block_manager.slots_for: token positions -> cache slots"),
    Seam("allocate_blocks", "ch03_paged_attention", "BlockAllocator.allocate: pop from the free list"),
    Seam("free_blocks", "ch03_paged_attention", "BlockAllocator.free: drop references, recycle at zero"),
    Seam("choose_victim", "ch03_paged_attention", "PagedScheduler: which running request to preempt"),
    Seam("paged_decode_attention", "ch03_paged_attention", "attention.torch_attention: one decode row"),
    Seam("store_kv_triton", "ch03_paged_attention", "attention: writing this step's K/V into the paged cache"),
    Seam("split_budget", "ch04_chunked_prefill", "PagedScheduler: prompt tokens each prefill gets this step"),
    Seam("rejection_sample_one", "ch05_speculative_sampling", "Speculator.verify: the rule, one request"),
    Seam("ngram_propose", "ch05_speculative_sampling", "NgramProposer.propose: one suffix length"),
    Seam("rollback_blocks", "ch05_speculative_sampling", "BlockManager.shrink: free rejected drafts' blocks"),
    Seam("next_num_speculative_tokens", "ch05_speculative_sampling", "policy.next_num_speculative_tokens"),
    Seam("longest_cached_prefix", "ch06_prefix_and_priority", "block_manager.longest_cached_prefix: the prefix-cache lookup"),
    Seam("allocate_with_eviction", "ch06_prefix_and_priority", "BlockAllocator.allocate with prefix caching: free list, then evict LRU"),
    Seam("admission_order", "ch06_prefix_and_priority", "scheduler.priority.admission_order"),
    Seam("poisson_arrivals", "ch07_serving_online", "bench.loadgen.poisson_arrivals: open-loop arrival times"),
    Seam("goodput", "ch07_serving_online", "bench.loadgen.goodput: requests per second within the SLO"),
    Seam("next_token_budget", "ch07_serving_online", "slo.slo_token_budget: the token-budget controller (bench.sweep and the engine's SLO controller)"),
    Seam("blocks_to_offload", "ch09_operating_slos", "BlockManager.offload_idle: idle prefix blocks to copy to the host tier"),
    Seam("slo_decision", "ch09_operating_slos", "slo.slo_decision: the SLO controller's next budget (its itl_break clamp stays)"),
    Seam("bootstrap_ci", "ch09_operating_slos", "bench.ab.bootstrap_diff: B - A of a percentile, its interval (flat)"),
    Seam("shard_linear", "ch10_beyond_one_device", "distributed.sharding.shard_linear: each rank's slice of a projection"),
    Seam("parallel_mlp", "ch10_beyond_one_device", "distributed.sharding.parallel_mlp: every rank's MLP and its all-reduce"),
    Seam("allreduce_bytes_per_step", "ch10_beyond_one_device", "distributed runner: the bytes-per-step formula it reports"),
    Seam("tree_attention_mask", "ch08_model_drafts_itself",
         "model_runner.tree_mask_bits: which nodes of a candidate tree each node attends to"),
    Seam("longest_accepted_path", "ch08_model_drafts_itself",
         "spec_decode.tree.accepted_path: the nodes a tree's exact walk accepts"),
    Seam("multi_candidate_rule", "ch08_model_drafts_itself",
         "spec_decode.tree.walk_tree: the exact rule at one node (move to a child, or emit from the residual)"),
    Seam("quantize_groups", "ch11_quantized_weights", "quantization.QuantizedLinear: quantizing each projection"),
    Seam("dequantize_groups", "ch11_quantized_weights",
         "quantization.QuantizedLinear.forward: the fused CPU kernel (yours dequantizes, F.linear multiplies)"),
    Seam("int8_gemv_triton", "ch11_quantized_weights",
         "quantization.QuantizedLinear.forward: the 8-bit group layers' CPU kernel"),
]}

class SeamContractError(ValueError):
    """A plugged function broke a rule the engine relies on; the engine stopped before acting on it.

    The message names the seam (and the exercise it comes from), the engine step when the
    call site knows it, the invariant in the contract's words, and what the function
    returned, e.g. ``seam schedule_step (exercises/ch02_continuous_batching.py), step 4:
    the rows must feed at most max_num_batched_tokens=64 tokens: they feed 67``. Raised
    before anything changes, so the engine is left as it was: no block lost or leaked.
    """

    def __init__(self, seam: str, invariant: str, got: str, step: int | None = None):
        self.seam, self.invariant, self.got, self.step = seam, invariant, got, step
        where = SEAMS[seam].chapter if seam in SEAMS else "?"
        at = f", step {step}" if step is not None else ""
        super().__init__(f"seam {seam} (exercises/{where}.py){at}: {invariant}: {got}")


_plugged: dict[str, Callable] = {}
_inside: set[str] = set()  # seams whose plugged function is running right now


def plugged(name: str) -> Callable | None:
    """The function plugged into seam ``name``, or None: the library's own code runs.

    While a plugged function runs, its own seam reads as unplugged: a function that calls
    the library's version (the reference answers in solutions/ do) gets the library's
    code, not itself again.
    """
    return None if name in _inside else _plugged.get(name)


def _guarded(name: str, fn: Callable) -> Callable:
    def call(*args, **kwargs):
        if name in _inside:
            return fn(*args, **kwargs)
        _inside.add(name)
        try:
            return fn(*args, **kwargs)
        finally:
            _inside.discard(name)

    call.__wrapped__ = fn
    return call


def _check(impls: dict[str, Callable]) -> None:
    for name, fn in impls.items():
        if name not in SEAMS:
            raise ValueError(f"{name!r} is not a seam; seams: {', '.join(SEAMS)}")
        if fn is not None and not callable(fn):
            raise ValueError(f"seam {name!r} needs a function with the signature of "
                             f"exercises/{SEAMS[name].chapter}.py::{name}, got {type(fn).__name__}")


@contextlib.contextmanager
def plug(**impls: Callable | None) -> Iterator[None]:
    """Use ``impls`` (seam name -> function; None leaves the library's) inside the block."""
    _check(impls)
    saved = dict(_plugged)
    _plugged.update({k: _guarded(k, v) for k, v in impls.items() if v is not None})
    try:
        yield
    finally:
        _plugged.clear()
        _plugged.update(saved)


def seams_of(chapter: str) -> list[Seam]:
    return [s for s in SEAMS.values() if s.chapter.startswith(chapter[:4])]


__all__ = ["Seam", "SEAMS", "SeamContractError", "plug", "plugged", "seams_of"]
