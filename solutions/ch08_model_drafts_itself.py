"""Chapter 8 solutions: same names and signatures as ``exercises/ch08_model_drafts_itself.py``.

The mask and the walk are ``minillm/spec_decode/tree.py``'s; the rule at one node is
``exact_tree_rule`` on a tree of that node and its children.
"""
from __future__ import annotations

import torch

from minillm.candidate_tree import TreeSpec
from minillm.spec_decode import tree as tree_lib
from minillm.course import quiz


def _check_parents(parents: list[int]) -> None:
    if not parents or parents[0] != -1 or any(not 0 <= parents[n] < n for n in range(1, len(parents))):
        raise ValueError(f"parents must start with -1 (the root) and point to earlier nodes, got {list(parents)}")


def _spec(parents: list[int]) -> TreeSpec:
    """A TreeSpec with these parents (the library's functions read only parents and children)."""
    n = len(parents)
    depths = [0] * n
    for i in range(1, n):
        depths[i] = depths[parents[i]] + 1
    return TreeSpec(choices=tuple(() for _ in range(n)), parents=tuple(parents), depths=tuple(depths),
                    ranks=tuple([-1] * n))


def tree_attention_mask(parents: list[int]) -> torch.Tensor:
    """Read ``minillm/spec_decode/tree.py``, ``tree_attention_mask``: each row follows the parents up to the root."""
    _check_parents(parents)
    return tree_lib.tree_attention_mask(parents)


def longest_accepted_path(parents: list[int], tokens: list[int], target_tokens: list[int]) -> list[int]:
    """Read ``minillm/spec_decode/tree.py``, ``accepted_path``: follow the child whose token is the target's."""
    if not len(parents) == len(tokens) == len(target_tokens):
        raise ValueError(f"parents, tokens and target_tokens must have one entry per node, got lengths "
                         f"{len(parents)}, {len(tokens)}, {len(target_tokens)}")
    _check_parents(parents)
    return tree_lib.accepted_path(_spec(parents), torch.tensor(tokens), torch.tensor(target_tokens))


def multi_candidate_rule(p: torch.Tensor, child_tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``exact_tree_rule`` on the node and its children: move[j] = p(x_j); the residual is p
    without the children's tokens, renormalized (p where nothing is left)."""
    m = len(child_tokens)
    spec = _spec([-1] + [0] * m)
    tokens = torch.tensor([0] + list(child_tokens), dtype=torch.long, device=p.device)
    move, emit = tree_lib.exact_tree_rule(spec, tokens, p[None].repeat(m + 1, 1))
    return move[1:].to(p.dtype), emit[0].to(p.dtype)


def expected_tokens_per_tree(parents: list[int], move: list[float]) -> float:
    """The sum over nodes of the probability of reaching them: the product of the moves on the path."""
    if len(parents) != len(move):
        raise ValueError(f"parents and move must have one entry per node, got {len(parents)} and {len(move)}")
    _check_parents(parents)
    if any(not 0.0 <= float(m) <= 1.0 for m in move[1:]):
        raise ValueError(f"moves are probabilities in [0, 1], got {list(move)}")
    out = [0.0] * len(parents)
    for n in range(1, len(parents)):
        out[parents[n]] += float(move[n])
    if max(out) > 1 + 1e-9:
        node = out.index(max(out))
        raise ValueError(f"the moves into node {node}'s children sum to {max(out)} > 1: the walk takes one child")
    reach = [1.0] * len(parents)
    for n in range(1, len(parents)):
        reach[n] = reach[parents[n]] * float(move[n])
    return float(sum(reach))


def quiz_answers() -> dict[str, str | float]:
    """The reference answers, kept as digests like the questions' own (``quiz.sealed``): ``make grade`` says whether
    yours is right. How to work them out: q1: every request's tree nodes and its root, in one forward; q2: the
    exact rule moves into a child with the target's probability of its token; q3: how typical acceptance treats
    a passing candidate and what it samples when it stops; q4: 1 + the probability of reaching each node
    (products of the moves on its path)."""
    return quiz.sealed("ch08")
