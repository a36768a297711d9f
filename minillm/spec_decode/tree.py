"""Candidate trees: verify several guesses per position in one forward (Medusa, SpecInfer).

A chain drafts one token per position and stops at the first wrong one. Medusa heads
give a *ranking* per position (head d's top-k for the token d + 1 ahead), so a tree can
try head 0's top-3, and under each of them head 1's top-2, and so on, in the same forward
(Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple
Decoding Heads"; Miao et al. 2024, "SpecInfer").

The tree's shape -- ``TreeSpec``, ``build_tree``, ``chain``, in Medusa's ``choices`` notation
(``(0, 1)``: head 0's top-1, then head 1's top-2) -- is plain Python in ``minillm.candidate_tree``
(the configuration checks trees with it), re-exported here. Node 0 is the **root**, the
request's last known token; nodes 1..N follow, parents before children.

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

from typing import Callable, Sequence

import torch

from minillm.candidate_tree import MAX_TREE_NODES, MEDUSA_TREE, TreeSpec, build_tree, chain  # noqa: F401 (the shape)
from minillm import seams
from minillm.sampling import exponential_race

TreeRule = Callable[["TreeSpec", torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


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
    if n == 0 or parents[0] != -1 or any(not 0 <= parents[j] < j for j in range(1, n)):
        raise ValueError(f"parents must be -1 for the root (node 0) and point to an earlier node for every "
                         f"other node, got {list(parents)}")
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
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
    if rule == "exact":
        mine = seams.plugged("multi_candidate_rule")  # a learner's rule, one node at a time (chapter 8)
        if mine is not None:
            return _walk_with_node_rule(mine, tree, tokens, p, noise)
        mine = seams.plugged("longest_accepted_path")  # a learner's walk (chapter 8)
        if mine is None:  # each node's sample only where the walk goes: at most depth + 1 of them
            return _walk_exact(tree, tokens, p, noise)
        y = exponential_race(p, noise[list(tree.depths)].to(p.dtype))  # [N+1]: each node's own sample
        token_list, targets = tokens.tolist(), y.tolist()
        path = _checked_path(mine(list(tree.parents), list(token_list), list(targets)), tree, token_list, targets)
    elif rule == "typical":
        move, _ = typical_tree_rule(tree, tokens, p, epsilon, delta)
        path = [0]
        while nxt := [c for c in tree.children(path[-1]) if move[c] > 0]:
            path.append(nxt[0])
        y = {path[-1]: exponential_race(p[path[-1]], noise[tree.depths[path[-1]]].to(p.dtype))}
    else:
        raise ValueError(f"rule must be 'exact' or 'typical', got {rule!r}")
    return path, [int(tokens[n]) for n in path[1:]] + [int(y[path[-1]])]


def _walk_exact(tree: TreeSpec, tokens: torch.Tensor, p: torch.Tensor,
                noise: torch.Tensor) -> tuple[list[int], list[int]]:
    """``walk_tree``'s exact walk, sampling only the nodes it visits: ``accepted_path`` with
    y_n = argmax(p_n / E_depth(n)) computed on arrival at node n."""
    path, token_list = [0], tokens.tolist()
    while True:
        n = path[-1]
        y = int(exponential_race(p[n], noise[tree.depths[n]].to(p.dtype)))
        nxt = [c for c in tree.children(n) if token_list[c] == y]
        if not nxt:
            return path, [token_list[c] for c in path[1:]] + [y]
        path.append(nxt[0])


def _checked_path(path, tree: TreeSpec, tokens: list[int], target_tokens: list[int]) -> list[int]:
    """A learner's accepted path, held to what the walk relies on before its tokens are emitted
    and its nodes' K/V moved: root first, each node a child of the one before it, and each accepted
    node's token the target's token after its parent (else the step would emit a token the target
    did not choose). A ``seams.SeamContractError`` naming the first node that breaks it."""
    def broken(invariant: str, got: str) -> seams.SeamContractError:
        return seams.SeamContractError("longest_accepted_path", invariant, f"{got} (path {path})")

    path = [int(n) for n in path]
    if not path or path[0] != 0:
        raise broken("the path starts at the root, node 0", f"it starts with {path[0] if path else 'nothing'}")
    for parent, n in zip(path, path[1:]):
        if not 0 < n < tree.num_nodes or tree.parents[n] != parent:
            raise broken("each node of the path is a child of the node before it",
                         f"node {n} follows node {parent}")
        if tokens[n] != target_tokens[parent]:
            raise broken("a node is accepted only if its token is the target's token after its parent",
                         f"node {n} holds {tokens[n]}; after node {parent} the target's is {target_tokens[parent]}")
    return path


def _check_node_rule(move: torch.Tensor, residual: torch.Tensor, child_tokens: list[int], vocab: int) -> None:
    """A learner's (move, residual) at one node, held to what drawing the node's token relies on:
    the shapes, moves that are probabilities of taking at most one child, and a residual that is a
    distribution. A ``seams.SeamContractError`` otherwise."""
    def broken(invariant: str, got: str) -> seams.SeamContractError:
        return seams.SeamContractError("multi_candidate_rule", invariant, f"{got} (children {child_tokens})")

    m = len(child_tokens)
    if move.shape != (m,) or residual.shape != (vocab,):
        raise broken(f"multi_candidate_rule must return (move [{m}], residual [{vocab}])",
                     f"shapes {tuple(move.shape)} and {tuple(residual.shape)}")
    if not bool(move.isfinite().all()) or bool((move < 0).any()) or bool((move > 1).any()) \
            or float(move.sum()) > 1 + 1e-6:
        raise broken("each move is a probability, and together they take at most one child (sum <= 1)",
                     f"move {[round(float(v), 6) for v in move]}")
    if not bool(residual.isfinite().all()) or bool((residual < 0).any()) or abs(float(residual.sum()) - 1) > 1e-6:
        total = float(residual.sum())
        raise broken("the residual is a distribution: finite, >= 0, summing to 1", f"it sums to {total:.6g}"
                     + ("" if bool(residual.isfinite().all()) else " (nan or inf in it)"))


def _walk_with_node_rule(rule, tree: TreeSpec, tokens: torch.Tensor, p: torch.Tensor,
                         noise: torch.Tensor) -> tuple[list[int], list[int]]:
    """``walk_tree``'s exact walk with a per-node rule ``rule(p [V], child_tokens) -> (move [m],
    residual [V])`` (chapter 8's ``multi_candidate_rule``): at node n of depth d, the token
    y = argmax(c / E_d) of c = sum_j move_j one_hot(x_j) + (1 - sum_j move_j) residual decides
    -- follow child j if y = x_j, else emit y. For the exact rule c is p_n itself, so the tokens
    are plain sampling's; a wrong rule changes their distribution."""
    path = [0]
    while True:
        n = path[-1]
        kids = tree.children(n)
        child_tokens = [int(tokens[c]) for c in kids]
        move, residual = rule(p[n], child_tokens)
        move = torch.as_tensor(move, dtype=p.dtype, device=p.device).reshape(-1)
        residual = torch.as_tensor(residual, dtype=p.dtype, device=p.device)
        _check_node_rule(move, residual, child_tokens, p.shape[1])
        combined = (1 - move.sum()).clamp(min=0) * residual
        if kids:
            combined[child_tokens] += move
        y = int(exponential_race(combined, noise[tree.depths[n]].to(p.dtype)))
        if y not in child_tokens:
            return path, [int(tokens[c]) for c in path[1:]] + [y]
        path.append(kids[child_tokens.index(y)])
