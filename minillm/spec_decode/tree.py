"""Candidate trees: verify several guesses per position in one forward (Medusa, SpecInfer).

A chain drafts one token per position and stops at the first wrong one. Medusa heads
give a *ranking* per position (head d's top-k for the token d + 1 ahead), so a tree can
try head 0's top-3, and under each of them head 1's top-2, and so on, in the same forward
(Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple
Decoding Heads"; Miao et al. 2024, "SpecInfer").

The tree is static, written as Medusa writes it: a list of ``choices``, one tuple per
node, each entry an index into one head's ranking. ``(0,)`` is head 0's top-1, ``(2,)``
its top-3, ``(0, 1)`` head 0's top-1 followed by head 1's top-2. Every prefix of a node
is a node. ``build_tree`` numbers the nodes: node 0 is the **root**, the request's last
known token (its token is known, the target's distribution after it is not); nodes
1..N follow by depth, then by choice, so a parent always comes before its children.

- ``TreeSpec`` / ``build_tree`` / ``chain``: the static shape (parents, depths, ranks);
- ``candidate_tokens``: the tokens of the nodes, from the heads' rankings;
- ``tree_attention_mask``: node i attends to node j iff j is i or one of i's ancestors
  (on top of the whole context before the root); ``tree_positions``: a node's position is
  the root's plus its depth -- siblings share a position;
- acceptance rules, split like ``rejection_sampler.verify_probs`` so the exactness test
  enumerates the very function the walk uses. A rule maps the tree's tokens and the
  target's distribution at every node ``p [N+1, V]`` to

      move [N+1]    P(the walk goes from node parent(c) to its child c | it reached parent(c));
      emit [N+1, V] the distribution of the token emitted where the walk stops.

  ``exact_tree_rule`` (multi-candidate rejection sampling with deterministic candidates;
  SpecInfer's rule for one-hot drafts) and ``typical_tree_rule`` (Medusa-2's typical
  acceptance: not exact, see its docstring);
- ``walk_tree``: the random half, driven by the same per-position Exp(1) noise as plain
  sampling (``minillm.sampling.position_noise``). With the exact rule it emits, token for
  token, what plain sampling emits with the same noise.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from minillm.sampling import exponential_race

TreeRule = Callable[["TreeSpec", torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class TreeSpec:
    """A static candidate tree of N + 1 nodes (node 0 the root), parents before children.

    choices[n]: node n's path of ranks (() for the root); parents[n]: its parent (-1 for
    the root); depths[n] = len(choices[n]); ranks[n]: the last entry of choices[n], the
    rank in head depths[n] - 1's ranking that gives node n its token (-1 for the root).
    """

    choices: tuple[tuple[int, ...], ...]
    parents: tuple[int, ...]
    depths: tuple[int, ...]
    ranks: tuple[int, ...]

    @property
    def num_nodes(self) -> int:
        """N + 1, the root included: the query rows one verification of this tree costs."""
        return len(self.choices)

    @property
    def depth(self) -> int:
        """The deepest node's depth: the most drafts one walk can accept (and heads it needs)."""
        return max(self.depths)

    @property
    def width(self) -> int:
        """1 + the largest rank used: how many candidates each head must rank."""
        return 1 + max(self.ranks)

    def children(self, node: int) -> list[int]:
        """Node's children, in node order (best rank first)."""
        return [c for c, p in enumerate(self.parents) if p == node]


def build_tree(choices: Sequence[Sequence[int]]) -> TreeSpec:
    """The TreeSpec of Medusa-style ``choices`` (the root is implied; order does not matter).

    Raises ValueError for an empty list, an empty or repeated choice, a negative rank, or
    a choice whose prefix is missing (its parent would not exist).
    """
    paths = [tuple(c) for c in choices]
    if not paths:
        raise ValueError("a tree needs at least one choice, e.g. [(0,)] (a chain of one draft)")
    seen: set[tuple[int, ...]] = set()
    for path in paths:
        if len(path) == 0:
            raise ValueError("a choice must be non-empty: the root () is implied")
        if any((not isinstance(r, int)) or isinstance(r, bool) or r < 0 for r in path):
            raise ValueError(f"choice {path}: ranks must be integers >= 0")
        if path in seen:
            raise ValueError(f"choice {path} is given twice")
        seen.add(path)
    for path in paths:
        if len(path) > 1 and path[:-1] not in seen:
            raise ValueError(f"choice {path} has no parent: add {path[:-1]} to the choices")
    ordered = [()] + sorted(paths, key=lambda c: (len(c), c))
    index = {c: n for n, c in enumerate(ordered)}
    return TreeSpec(
        choices=tuple(ordered),
        parents=tuple(-1 if not c else index[c[:-1]] for c in ordered),
        depths=tuple(len(c) for c in ordered),
        ranks=tuple(c[-1] if c else -1 for c in ordered),
    )


def chain(k: int) -> TreeSpec:
    """The chain of k drafts as a tree: (0,), (0, 0), ... -- every head's top-1."""
    if k < 1:
        raise ValueError(f"a chain needs k >= 1 drafts, got {k}")
    return build_tree([(0,) * d for d in range(1, k + 1)])


def candidate_tokens(tree: TreeSpec, root_token: int, head_ranking: torch.Tensor) -> torch.Tensor:
    """The token of every node: [N+1] long.

    head_ranking [K, W] long: row d is head d's candidates, best first (W >= tree.width,
    K >= tree.depth). Node n at depth d >= 1 takes head_ranking[d - 1, ranks[n]]; the root
    takes ``root_token``. Siblings have distinct ranks in one head's ranking, so distinct
    tokens.
    """
    if head_ranking.dim() != 2 or head_ranking.shape[0] < tree.depth or head_ranking.shape[1] < tree.width:
        raise ValueError(f"head_ranking must be [K >= {tree.depth}, W >= {tree.width}] for this tree, "
                         f"got {tuple(head_ranking.shape)}")
    rows = torch.tensor([max(d - 1, 0) for d in tree.depths], dtype=torch.long, device=head_ranking.device)
    cols = torch.tensor([max(r, 0) for r in tree.ranks], dtype=torch.long, device=head_ranking.device)
    tokens = head_ranking[rows, cols].clone()
    tokens[0] = root_token
    return tokens


def tree_attention_mask(parents: Sequence[int]) -> torch.Tensor:
    """[N+1, N+1] bool: mask[i, j] is True iff node j is node i or an ancestor of it.

    The query of node i may read the keys of exactly those nodes (and the whole context
    before the root): then each node sees the sequence of its own path and nothing of its
    siblings' branches, as if that path had been run alone.
    """
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            if j >= n or (parents[j] >= j and j != 0):
                raise ValueError(f"parents must point to earlier nodes (node {j} has parent {parents[j]})")
            mask[i, j] = True
            j = parents[j]
    return mask


def tree_positions(depths: Sequence[int], root_position: int) -> torch.Tensor:
    """[N+1] long: node n sits at root_position + depths[n] (siblings share a position)."""
    return root_position + torch.tensor(list(depths), dtype=torch.long)


# ---------------------------------------------------------------- acceptance rules


def _check(tree: TreeSpec, tokens: torch.Tensor, target_probs: torch.Tensor) -> None:
    n = tree.num_nodes
    if tokens.shape != (n,):
        raise ValueError(f"tokens must be [N+1] = [{n}], got {tuple(tokens.shape)}")
    if target_probs.dim() != 2 or target_probs.shape[0] != n:
        raise ValueError(f"target_probs must be [N+1, V] = [{n}, V], got {tuple(target_probs.shape)}")


def exact_tree_rule(tree: TreeSpec, tokens: torch.Tensor, target_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-candidate rejection sampling for deterministic candidates: exact.

    At node n with children c_1..c_m (distinct tokens x_1..x_m) and target p = p_n, try the
    children in turn: accept x_1 with probability p(x_1) / 1; on rejection the target
    becomes the residual p without x_1, renormalized; accept x_2 with its probability
    under that residual; ... (SpecInfer's rule with one-hot drafts). Multiplying out,
    the walk moves to c_j with probability p(x_j) -- as if it had drawn y ~ p and followed
    the child whose token is y -- and if no child is taken it emits a sample of p with
    x_1..x_m removed, renormalized. So every emitted token, accepted or not, is a sample
    of the target's distribution at its position: the output is distributed exactly as
    plain sampling's. (Greedy p is one-hot: the walk follows the argmax child when there
    is one, else emits the argmax.)
    """
    _check(tree, tokens, target_probs)
    p = target_probs.to(torch.promote_types(target_probs.dtype, torch.float64))
    parents = torch.tensor(tree.parents, dtype=torch.long, device=p.device)
    move = torch.ones(tree.num_nodes, dtype=p.dtype, device=p.device)
    move[1:] = p[parents[1:], tokens[1:]]
    emit = p.clone()
    emit[parents[1:], tokens[1:]] = 0.0  # a node's children tokens are not emitted when the walk stops there
    mass = emit.sum(-1, keepdim=True)
    emit = torch.where(mass > 0, emit / mass.clamp(min=torch.finfo(p.dtype).tiny), p)  # mass 0: never stopped at
    return move, emit


def typical_threshold(p: torch.Tensor, epsilon: float, delta: float) -> torch.Tensor:
    """min(epsilon, delta * exp(-H(p))) over the last dim: Medusa-2's typical acceptance bar."""
    logp = torch.where(p > 0, p.log(), 0.0)
    entropy = -(p * logp).sum(-1)
    return torch.minimum(torch.full_like(entropy, epsilon), delta * torch.exp(-entropy))


def typical_tree_rule(tree: TreeSpec, tokens: torch.Tensor, target_probs: torch.Tensor,
                      epsilon: float = 0.09, delta: float = 0.3) -> tuple[torch.Tensor, torch.Tensor]:
    """Medusa-2's typical acceptance (Cai et al. 2024, section 2.3.1): NOT exact.

    A candidate x under node n passes when p_n(x) > min(epsilon, delta * exp(-H(p_n))):
    plausible enough, the bar lower where the target is unsure. The walk takes, with
    probability 1, the passing child with the longest run of passing descendants (ties:
    the better rank), and where no child passes it emits a sample of p_n itself. Medusa's
    defaults: epsilon 0.09, delta 0.3 (about sqrt(epsilon)).

    Why it is not exact: a passing candidate is taken with probability 1 where the target
    would emit it with probability p(x) < 1, and the token emitted on stopping is drawn
    from p_n with the rejected candidates still in it. Greedy targets are one-hot, where
    only the argmax passes: it is exact there.
    """
    _check(tree, tokens, target_probs)
    p = target_probs.to(torch.promote_types(target_probs.dtype, torch.float64))
    bar = typical_threshold(p, epsilon, delta)  # [N+1]
    passes = [n > 0 and float(p[tree.parents[n], tokens[n]]) > float(bar[tree.parents[n]])
              for n in range(tree.num_nodes)]
    run = [0] * tree.num_nodes  # longest chain of passing nodes below n (n itself not counted)
    for n in reversed(range(tree.num_nodes)):
        run[n] = max((1 + run[c] for c in tree.children(n) if passes[c]), default=0)
    move = torch.zeros(tree.num_nodes, dtype=p.dtype, device=p.device)
    move[0] = 1.0
    for n in range(tree.num_nodes):
        kids = [c for c in tree.children(n) if passes[c]]
        if kids:
            move[max(kids, key=lambda c: (run[c], -c))] = 1.0
    return move, p


def accepted_path(tree: TreeSpec, tokens: torch.Tensor, target_tokens: torch.Tensor) -> list[int]:
    """The nodes a walk accepts when the target's token at each node is given: [N+1] long.

    From the root, go to the child whose token is target_tokens[current node], while
    there is one. Returns the accepted nodes, root first (the root always). The tokens
    emitted are those of the accepted nodes after the root, then target_tokens[last node].
    Greedy: target_tokens is the argmax at every node, and this is the longest accepted path.
    """
    path = [0]
    while True:
        n = path[-1]
        nxt = [c for c in tree.children(n) if int(tokens[c]) == int(target_tokens[n])]
        if not nxt:
            return path
        path.append(nxt[0])


def walk_tree(tree: TreeSpec, tokens: torch.Tensor, target_probs: torch.Tensor, noise: torch.Tensor,
              rule: str = "exact", epsilon: float = 0.09, delta: float = 0.3) -> tuple[list[int], list[int]]:
    """One verification of a tree, with the noise of the positions: (accepted nodes, emitted tokens).

    noise [tree.depth + 1, V] of Exp(1): row d is the noise of the position at depth d
    (the token after the root is at depth 0's row). ``rule="exact"``: at node n of depth
    d the target's own token y = argmax(p_n / E_d) -- plain sampling's token at that
    position -- is followed into the child that has it, or emitted. That is
    ``exact_tree_rule`` (P(move to c) = p_n(x_c); on stopping y is p_n conditioned on not
    being a child), and the emitted tokens ARE plain sampling's with the same noise.
    ``rule="typical"``: ``typical_tree_rule``'s path, then argmax(p_n / E_d) at its end.
    Returns the accepted nodes (root first) and the tokens emitted: len(accepted) of them.
    """
    _check(tree, tokens, target_probs)
    if noise.shape != (tree.depth + 1, target_probs.shape[1]):
        raise ValueError(f"noise must be [depth + 1, V] = [{tree.depth + 1}, {target_probs.shape[1]}], "
                         f"got {tuple(noise.shape)}")
    p = target_probs.to(torch.promote_types(target_probs.dtype, torch.float64))
    y = exponential_race(p, noise[list(tree.depths)].to(p.dtype))  # [N+1]: each node's own sample
    if rule == "exact":
        path = accepted_path(tree, tokens, y)
    elif rule == "typical":
        move, _ = typical_tree_rule(tree, tokens, p, epsilon, delta)
        path = [0]
        while nxt := [c for c in tree.children(path[-1]) if move[c] > 0]:
            path.append(nxt[0])
    else:
        raise ValueError(f"rule must be 'exact' or 'typical', got {rule!r}")
    return path, [int(tokens[n]) for n in path[1:]] + [int(y[path[-1]])]
