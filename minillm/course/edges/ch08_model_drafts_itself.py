"""Chapter 8's edges: Medusa trees verified in one forward, greedy and sampled, on a tiny model.

The heads are fitted to the tiny model's own greedy continuations (a few hundred Adam steps,
once per process), so trees are accepted deep: paths reach depth 3, where a node's mask must
hold its grandparent, and accepted nodes move their K/V across block edges (blocks of 8, trees
of 13 nodes). Greedy, the heads' right token is made to rank second on heads 0 and 2, so the
accepted paths go through nodes that are not first children: a mask that lets a node read its
siblings, or a walk that tries only the first child, changes what the engine emits. Sampled
(seeded, temperature 0.9), an exact rule gives plain sampling's tokens; a nearly right one
changes them.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch


from . import EdgeCase

TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 0, 1)]
CH08 = ("tree_attention_mask", "longest_accepted_path", "multi_candidate_rule")


@lru_cache(maxsize=1)
def tiny():
    """A tiny model whose greedy output wanders (the dummy weights x10), and its config."""
    from minillm import loader
    from minillm.config import ModelConfig

    cfg = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=256)
    weights = {k: (v * 10 if v.dim() == 2 else v) for k, v in loader.dummy_weights(cfg, seed=0).items()}
    return cfg, weights


def engine(model=None, **kwargs):
    """An engine on ``model`` ((config, weights); default ``tiny()``)."""
    from minillm.config import EngineConfig
    from minillm.engine import build_engine

    cfg, weights = model or tiny()
    opts = dict(engine="paged", device="cpu", dtype="float32", max_model_len=256, block_size=8, max_num_seqs=4,
                seed=0, attention_backend="cpu") | kwargs
    return build_engine(EngineConfig(**opts), weights=weights, model_config=cfg, tokenizer=None)


def run(eng, prompts, temperature: float = 0.0, max_tokens: int = 24) -> dict[str, Any]:
    """The tokens, the step schedule (requests, tokens fed) and the drafts accepted."""
    from minillm import SamplingParams

    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True,
                             seed=None if temperature == 0 else 11 + i) for i in range(len(prompts))]
    outs = eng.run([eng.make_request(p, sp) for p, sp in zip(prompts, params)])
    return {"tokens": [o.token_ids for o in outs],
            "schedule": [(tuple(s.request_ids), tuple(s.num_new_tokens)) for s in eng.step_records],
            "drafts accepted": eng.spec_stats.num_accepted if eng.spec_stats is not None else 0}


def _final_hidden(model, token_ids: list[int]) -> torch.Tensor:
    """The model's final hidden states [T, hidden] over one sequence (what the heads read)."""
    from minillm.model_runner import allocate_kv_cache, build_batch
    from minillm.request import Request
    from minillm.sampling_params import SamplingParams
    from minillm.scheduler.output import ScheduledRequest

    block_size = 16
    blocks = -(-len(token_ids) // block_size)
    caches = allocate_kv_cache(model.cfg, blocks, block_size, torch.device("cpu"), torch.float32)
    req = Request("hidden", list(token_ids), SamplingParams())
    req.block_ids = list(range(blocks))
    b = build_batch([ScheduledRequest(req, len(token_ids))], block_size, torch.device("cpu"))
    with torch.inference_mode():
        return model(b.input_ids, b.positions, b.meta, caches).clone()


@lru_cache(maxsize=1)
def fitted_medusa():
    """Four prompts, and three Medusa heads fitted to the tiny model's greedy continuations of them."""
    from minillm.spec_decode.medusa import MedusaHeads, head_positions

    cfg, weights = tiny()
    prompts = [[(7 * i + 3 * j) % 120 + 4 for j in range(5 + 9 * i)] for i in range(4)]
    plain = engine()
    want = run(plain, prompts)["tokens"]
    seqs = [p + o for p, o in zip(prompts, want)]
    hidden = [_final_hidden(plain.model, s) for s in seqs]
    torch.manual_seed(0)
    heads = MedusaHeads(weights["embed.weight"], num_heads=3)
    opt = torch.optim.Adam(heads.parameters(), lr=3e-2)
    rows = []
    for k in range(3):
        pos = [head_positions(len(s), k, len(p) - 1) for s, p in zip(seqs, prompts)]
        rows.append((torch.cat([h[t] for h, (t, _) in zip(hidden, pos)]),
                     torch.cat([torch.tensor(s)[tgt] for s, (_, tgt) in zip(seqs, pos)])))
    for _ in range(300):
        opt.zero_grad()
        sum(heads.loss(x, y, k) for k, (x, y) in enumerate(rows)).backward()
        opt.step()
    heads.requires_grad_(False)
    return prompts, heads


class SecondBest(torch.nn.Module):
    """Heads whose top two candidates are swapped on heads 0 and 2: the right token ranks second."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, hidden, heads=None):
        logits = self.inner(hidden, heads)
        top2 = logits.topk(2, dim=-1).indices
        out = logits.clone()
        for k in range(0, logits.shape[0], 2):
            out[k].scatter_(-1, top2[k, :, :1], logits[k].gather(-1, top2[k, :, 1:]))
            out[k].scatter_(-1, top2[k, :, 1:], logits[k].gather(-1, top2[k, :, :1]))
        return out


def _tree_run(temperature: float, second_best: bool) -> dict[str, Any]:
    prompts, heads = fitted_medusa()
    eng = engine(speculative={"method": "medusa", "heads": heads, "tree": TREE, "disable_by_batch_size": None})
    if second_best:
        eng.speculator.drafter.heads = SecondBest(eng.speculator.drafter.heads)
    return run(eng, prompts, temperature)


def greedy_second_best() -> dict[str, Any]:
    """Greedy Medusa trees whose right tokens rank second on heads 0 and 2."""
    return _tree_run(0.0, second_best=True)


def sampled() -> dict[str, Any]:
    """Medusa trees at temperature 0.9, every request seeded."""
    return _tree_run(0.9, second_best=False)


@lru_cache(maxsize=1)
def steady():
    """A model whose next token hardly depends on the context: every embedding is a multiple of
    one direction (plus a little noise) and the layers are weak, so after a few tokens every
    position's distribution is about the same, a few tokens of 0.1 to 0.5. Untrained Medusa heads
    (its LM head) then draft its likeliest tokens at every depth: candidates the target gives real
    probability, where a rule that is nearly right draws other tokens."""
    from minillm.model import Llama

    cfg, _ = tiny()
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Llama(cfg).state_dict().items()}
    g = torch.Generator().manual_seed(5)
    weights = {k: (torch.ones(s) if "norm" in k else torch.randn(s, generator=g) * 0.02) for k, s in shapes.items()}
    direction = torch.randn(cfg.hidden_size, generator=g)
    strength = torch.rand(cfg.vocab_size, generator=g) ** 4  # a few tokens well above the rest
    weights["embed.weight"] = (5 * strength[:, None] * (direction / direction.norm())[None, :]
                               + 0.05 * torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g))
    return cfg, weights


def sampled_steady() -> dict[str, Any]:
    """Seeded sampling at temperature 1 on ``steady``'s model, drafting its likeliest tokens."""
    from minillm.spec_decode.medusa import MedusaHeads

    cfg, weights = steady()
    heads = MedusaHeads(weights["embed.weight"], num_heads=3)
    eng = engine(speculative={"method": "medusa", "heads": heads, "tree": TREE, "disable_by_batch_size": None},
                 model=(cfg, weights))
    prompts = [[(5 * i + 11 * j) % 120 + 4 for j in range(4 + 3 * i)] for i in range(4)]
    return run(eng, prompts, temperature=1.0)


CASES = [
    # Deep greedy paths through second children, K/V moved across block edges; greedy targets are
    # one-hot, so where a child holds the argmax the children hold all of p (the rule's residual is p).
    EdgeCase("greedy trees accepted deep through second-ranked candidates", CH08, greedy_second_best),
    # Seeded sampling: every node's move and residual decide the token drawn with the position's noise.
    EdgeCase("sampled trees (temperature 0.9, seeded): each node's token drawn from the rule", CH08, sampled),
    # Every node's candidates are the target's likeliest tokens (0.1 to 0.5 each): the second one's
    # move is its probability under p, not under the residual it is tried against.
    EdgeCase("sampled trees whose candidates all have real probability", CH08, sampled_steady),
]
