"""Wrong answers to exercises/ch08_model_drafts_itself.py, each a mistake the contract rules out."""
from __future__ import annotations

import torch

from mutants import mutant


def _check_parents(parents):
    if not parents or parents[0] != -1 or any(not 0 <= parents[n] < n for n in range(1, len(parents))):
        raise ValueError(f"bad parents {parents}")


def _children(parents):
    kids = [[] for _ in parents]
    for n in range(1, len(parents)):
        kids[parents[n]].append(n)
    return kids


# ---------------------------------------------------------------- tree_attention_mask


@mutant("tree_attention_mask", "the causal lower triangle for every tree: a node also reads its siblings' branches")
def _causal_triangle(parents):
    _check_parents(parents)
    n = len(parents)
    return torch.ones(n, n, dtype=torch.bool).tril()


@mutant("tree_attention_mask", "a node reads its ancestors but not itself (the diagonal is left out)")
def _not_itself(parents):
    _check_parents(parents)
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(1, n):
        mask[i] = mask[parents[i]]
        mask[i, parents[i]] = True
    return mask


@mutant("tree_attention_mask", "a node reads itself and its parent only, not the ancestors above it")
def _parent_only(parents):
    _check_parents(parents)
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        mask[i, parents[i]] = True
    return mask


@mutant("tree_attention_mask", "the mask is transposed: a node reads its descendants, not its ancestors")
def _descendants(parents):
    _check_parents(parents)
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        mask[i] = mask[parents[i]] if i else mask[i]
        mask[i, i] = True
    return mask.T.contiguous()


# ---------------------------------------------------------------- longest_accepted_path


def _check_lengths(parents, tokens, target_tokens):
    if not len(parents) == len(tokens) == len(target_tokens):
        raise ValueError("lists of different lengths")
    _check_parents(parents)


@mutant("longest_accepted_path", "only the first child of each node is tried (the top-ranked candidate)")
def _first_child_only(parents, tokens, target_tokens):
    _check_lengths(parents, tokens, target_tokens)
    kids, path = _children(parents), [0]
    while kids[path[-1]] and tokens[kids[path[-1]][0]] == target_tokens[path[-1]]:
        path.append(kids[path[-1]][0])
    return path


@mutant("longest_accepted_path", "a child is compared with its own target token, not its parent's")
def _child_against_its_own_target(parents, tokens, target_tokens):
    _check_lengths(parents, tokens, target_tokens)
    kids, path = _children(parents), [0]
    while True:
        nxt = [c for c in kids[path[-1]] if tokens[c] == target_tokens[c]]
        if not nxt:
            return path
        path.append(nxt[0])


@mutant("longest_accepted_path", "the root is left out of the path")
def _no_root(parents, tokens, target_tokens):
    _check_lengths(parents, tokens, target_tokens)
    kids, path = _children(parents), [0]
    while True:
        nxt = [c for c in kids[path[-1]] if tokens[c] == target_tokens[path[-1]]]
        if not nxt:
            return path[1:]
        path.append(nxt[0])


@mutant("longest_accepted_path", "the deepest node whose own token matches is taken, whether or not the nodes above "
                                 "it were accepted")
def _deepest_match_anywhere(parents, tokens, target_tokens):
    _check_lengths(parents, tokens, target_tokens)
    paths = []
    for n, par in enumerate(parents):
        paths.append([n] if par < 0 else paths[par] + [n])
    matching = [p for n, p in enumerate(paths) if n == 0 or tokens[n] == target_tokens[parents[n]]]
    return max(matching, key=len)


# ---------------------------------------------------------------- multi_candidate_rule


def _move_and_removed(p, child_tokens):
    move = p[child_tokens].clone() if child_tokens else p.new_zeros(0)
    rest = p.clone()
    if child_tokens:
        rest[child_tokens] = 0.0
    return move, rest


@mutant("multi_candidate_rule", "the residual keeps the children's tokens: p itself, so they get their mass twice")
def _residual_keeps_children(p, child_tokens):
    move, _ = _move_and_removed(p, child_tokens)
    return move, p.clone()


@mutant("multi_candidate_rule", "the residual is not renormalized after the children's tokens are set to 0")
def _residual_not_renormalized(p, child_tokens):
    move, rest = _move_and_removed(p, child_tokens)
    return move, rest


@mutant("multi_candidate_rule", "move[j] is x_j's probability under the residual it is tried against, without the "
                                "probability of having been rejected before")
def _conditional_moves(p, child_tokens):
    residual, move = p.clone(), []
    for x in child_tokens:
        move.append(residual[x].clone())
        residual[x] = 0.0
        if residual.sum() > 0:
            residual = residual / residual.sum()
        else:
            residual = p.clone()
    return torch.stack(move) if move else p.new_zeros(0), residual


@mutant("multi_candidate_rule", "when the children hold all of p, the residual is 0 / 0 (NaN), not p")
def _no_mass_left_is_nan(p, child_tokens):
    move, rest = _move_and_removed(p, child_tokens)
    return move, rest / rest.sum()


# ---------------------------------------------------------------- expected_tokens_per_tree


def _check_tree(parents, move):
    if len(parents) != len(move):
        raise ValueError("lists of different lengths")
    _check_parents(parents)
    if any(not 0.0 <= float(m) <= 1.0 for m in move[1:]):
        raise ValueError("a move outside [0, 1]")
    out = [0.0] * len(parents)
    for n in range(1, len(parents)):
        out[parents[n]] += float(move[n])
    if max(out) > 1 + 1e-9:
        raise ValueError("children's moves sum to more than 1")


def _reach(parents, move):
    reach = [1.0] * len(parents)
    for n in range(1, len(parents)):
        reach[n] = reach[parents[n]] * float(move[n])
    return reach


@mutant("expected_tokens_per_tree", "each node counts its own move, not the product of the moves on its path")
def _own_move_only(parents, move):
    _check_tree(parents, move)
    return float(1.0 + sum(float(m) for m in move[1:]))


@mutant("expected_tokens_per_tree", "the root's 1 is left out (only the accepted drafts are counted)")
def _no_root_token(parents, move):
    _check_tree(parents, move)
    return float(sum(_reach(parents, move)) - 1.0)


@mutant("expected_tokens_per_tree", "move[0] is multiplied in, though the walk always starts at the root")
def _root_move_read(parents, move):
    _check_tree(parents, move)
    reach = [float(move[0])] + [0.0] * (len(parents) - 1)
    for n in range(1, len(parents)):
        reach[n] = reach[parents[n]] * float(move[n])
    return float(sum(reach))


@mutant("expected_tokens_per_tree", "children's moves that sum to 1 up to rounding are refused (no 1e-9 allowance)")
def _no_rounding_allowance(parents, move):
    _check_tree(parents, move)
    out = [0.0] * len(parents)
    for n in range(1, len(parents)):
        out[parents[n]] += float(move[n])
    if max(out) > 1:
        raise ValueError("children's moves sum to more than 1")
    return float(sum(_reach(parents, move)))


@mutant("expected_tokens_per_tree", "children's moves that sum to more than 1 are not refused")
def _children_sum_unchecked(parents, move):
    if len(parents) != len(move):
        raise ValueError("lists of different lengths")
    _check_parents(parents)
    if any(not 0.0 <= float(m) <= 1.0 for m in move[1:]):
        raise ValueError("a move outside [0, 1]")
    return float(sum(_reach(parents, move)))
