"""Chapter 10's edges: heads and MLP columns that split unevenly, and a real two-rank engine
whose every MLP is summed over the ranks once and whose every step's bytes are reported.

The shards are cut by the library's caller itself (``sharding.shard_weights``, what
``LLM(tensor_parallel_size=N)`` runs for each rank), without starting processes. The MLP
and the bytes need the ranks: one engine of two gloo processes on a tiny random model.
"""
from __future__ import annotations

from functools import partial
from typing import Any

import torch

from minillm.config import ModelConfig

from . import EdgeCase

# 3 KV groups of 2 query heads: 2 ranks hold 2 groups and 1; 100 MLP columns: 3 ranks hold 34, 33, 33.
UNEVEN = ModelConfig(vocab_size=64, hidden_size=24, intermediate_size=100, num_layers=2, num_heads=6,
                     num_kv_heads=3, head_dim=4, max_position_embeddings=64)
# The engine's model: large enough random weights that greedy tokens vary from step to step.
TINY = ModelConfig(vocab_size=128, hidden_size=48, intermediate_size=96, num_layers=2, num_heads=6, num_kv_heads=3,
                   head_dim=8, max_position_embeddings=128)
PROMPTS = [[1, 5, 9, 13, 7, 3], [1, 22, 33, 44], [1, 9, 8, 7, 6, 5, 4, 3, 2, 10, 11]]
TEACHER_FORCED = [1, 17, 4, 90, 33, 2, 61, 8, 120, 45, 7, 77, 12, 5, 99, 31]


def random_weights(cfg: ModelConfig, seed: int, std: float = 0.3) -> dict[str, torch.Tensor]:
    """Weights of ``cfg`` drawn at ``std`` (norms at 1)."""
    from minillm.model import Llama

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Llama(cfg).state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    return {k: (torch.ones(s) if "norm" in k else torch.randn(s, generator=g) * std) for k, s in shapes.items()}


def shards(world_sizes: tuple[int, ...]) -> dict[str, Any]:
    """Every rank's shard of every projection of ``UNEVEN``, for each world size."""
    from minillm.distributed.sharding import shard_weights

    weights = random_weights(UNEVEN, seed=1)
    out = {}
    for n in world_sizes:
        for rank in range(n):
            for name, w in shard_weights(UNEVEN, weights, n, rank).items():
                if name.startswith("layers.") and "norm" not in name:
                    out[f"{n} ranks, rank {rank}: {name}"] = (str(w.dtype), tuple(w.shape), w.tolist())
    return out


def two_ranks() -> dict[str, Any]:
    """A two-rank engine (gloo processes): the top-3 tokens at every position of a teacher-forced
    prompt, then three requests' greedy tokens, with the runner's counts."""
    from minillm import SamplingParams
    from minillm.config import EngineConfig
    from minillm.engine import build_engine

    engine = build_engine(EngineConfig(tensor_parallel_size=2, engine="paged", attention_backend="cpu",
                                       max_model_len=64, block_size=8, cpu_threads=1),
                          weights=random_weights(TINY, seed=0), tokenizer=None, model_config=TINY)
    try:
        runner = engine.runner
        ranking = runner.prompt_logits(TEACHER_FORCED).topk(3, dim=-1).indices.tolist()
        runner.reset_counts()
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        tokens = [o.token_ids for o in engine.run([engine.make_request(p, params) for p in PROMPTS])]
        counts = runner.counts()
    finally:
        engine.close()
    return {"top-3 tokens at every position of a prompt": ranking, "tokens": tokens,
            "steps": counts["steps"], "all-reduce calls": counts["all_reduce_calls"],
            "bytes all-reduced": counts["all_reduce_bytes"], "bytes by the formula": counts["formula_bytes"]}


CASES = [
    # k_proj's 12 rows cut [8, 4] (2 KV heads and 1), o_proj's columns [16, 8]; the MLP's 100
    # columns cut [34, 33, 33] over three ranks: pieces of unequal sizes, none at offset rank * size.
    EdgeCase("heads and MLP columns that split unevenly (2 + 1 KV heads; 34 + 33 + 33 columns)",
             ("shard_linear",), partial(shards, (2, 3))),
    # Every MLP's output is the sum over the ranks; every step reports its bytes: a prefill of
    # three prompts (21 tokens), then decode steps of three tokens.
    EdgeCase("a two-rank engine: each MLP summed over the ranks once, each step's bytes reported",
             ("parallel_mlp", "allreduce_bytes_per_step"), two_ranks),
]
