"""Grades exercises/ch08_model_drafts_itself.py (or solutions/, with MINILLM_IMPL=solutions).

Oracles are written here (plain Python and PyTorch, float64), never taken from minillm, so
the tests stay meaningful for the solutions that wrap minillm. The last tests plug your
functions into a Medusa tree engine on a tiny model with dummy weights and check that it
still gives the library's tokens and step schedule. Seconds to run.
"""
from __future__ import annotations

import functools
import random

import pytest
import torch
import torch.nn.functional as F

import adapters
from minillm import seams
from minillm.course import quiz

pytestmark = pytest.mark.exercises

CHAPTER = "ch08_model_drafts_itself"
tree_attention_mask = adapters.function(CHAPTER, "tree_attention_mask")
longest_accepted_path = adapters.function(CHAPTER, "longest_accepted_path")
multi_candidate_rule = adapters.function(CHAPTER, "multi_candidate_rule")
expected_tokens_per_tree = adapters.function(CHAPTER, "expected_tokens_per_tree")
quiz_answers = adapters.function(CHAPTER, "quiz_answers")


def _expect_value_error(fn, *args, what: str):
    __tracebackhide__ = True
    try:
        got = fn(*args)
    except ValueError:
        return
    except Exception as e:  # noqa: BLE001 -- reported in one line: which error came instead
        pytest.fail(f"{what}: expected ValueError, got {type(e).__name__}: {e}", pytrace=False)
    pytest.fail(f"{what}: expected ValueError, got a return value of type {type(got).__name__}", pytrace=False)


# ---------------------------------------------------------------- trees, written here

# Medusa's choices: (0,) head 0's top-1, (1,) its top-2, (0, 1) head 0's top-1 then head 1's top-2, ...
MEDUSA_LIKE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


def _from_choices(choices) -> list[int]:
    """Parents of the nodes numbered root first, then by depth and choice (parents before children)."""
    ordered = [()] + sorted(choices, key=lambda c: (len(c), c))
    index = {c: n for n, c in enumerate(ordered)}
    return [-1] + [index[c[:-1]] for c in ordered[1:]]


def _random_parents(n: int, seed: int) -> list[int]:
    """A random tree of n + 1 nodes numbered in creation order: each node's parent any earlier node."""
    rng = random.Random(seed)
    return [-1] + [rng.randrange(i) for i in range(1, n + 1)]


def _paths(parents: list[int]) -> list[list[int]]:
    """Each node's path from the root, root first."""
    paths: list[list[int]] = []
    for n, par in enumerate(parents):
        paths.append([n] if par < 0 else paths[par] + [n])
    return paths


def _children(parents: list[int]) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in parents]
    for n, par in enumerate(parents[1:], start=1):
        kids[par].append(n)
    return kids


# ---------------------------------------------------------------- tree_attention_mask


def _check_mask(parents: list[int], what: str):
    __tracebackhide__ = True
    n = len(parents)
    got = tree_attention_mask(list(parents))
    adapters.expect_that(isinstance(got, torch.Tensor), what, "a torch.Tensor", type(got).__name__)
    adapters.expect((got.dtype, tuple(got.shape)), (torch.bool, (n, n)), f"{what}: (dtype, shape)")
    paths = _paths(parents)
    for i in range(n):
        for j in range(n):
            want = j in paths[i]
            if bool(got[i, j]) != want:
                pytest.fail(f"{what}: mask[{i}, {j}]: expected {want} (node {i}'s path from the root is "
                            f"{paths[i]}: node {j} is {'' if want else 'not '}on it), got {bool(got[i, j])}",
                            pytrace=False)
    return got


def test_tree_attention_mask_example():
    """The docstring's example: mask[i, j] is True iff node j is node i itself or one of its ancestors."""
    _check_mask([-1, 0, 0, 1], "tree_attention_mask([-1, 0, 0, 1])")


def test_tree_attention_mask_of_a_chain_is_causal():
    """Contract: for a chain the mask is the usual causal lower triangle."""
    got = tree_attention_mask([-1, 0, 1, 2, 3])
    adapters.expect(torch.as_tensor(got).tolist(), torch.ones(5, 5, dtype=torch.bool).tril().tolist(),
                    "tree_attention_mask of a chain [-1, 0, 1, 2, 3] (the causal lower triangle)")


@pytest.mark.exercises(points=2)
@pytest.mark.parametrize("case", ["medusa-like", "star-9", "random-12", "random-30", "random-62"])
def test_tree_attention_mask_is_ancestor_or_self(case):
    """Contract: [N+1, N+1] bool, mask[i, j] True iff node j is node i or one of its ancestors (up to the root),
    exact element for element."""
    parents = {"medusa-like": _from_choices(MEDUSA_LIKE), "random-12": _random_parents(12, 1),
               "random-30": _random_parents(30, 2), "random-62": _random_parents(62, 3),
               "star-9": [-1] + [0] * 9}[case]
    _check_mask(parents, f"tree_attention_mask({parents})")


def test_tree_attention_mask_rejects_bad_parents():
    """Contract: parents[0] != -1, or any parents[n] outside [0, n) for n >= 1 -> ValueError."""
    for bad in ([0, 0], [-1, 1], [-1, 0, 3], [-1, 0, -1]):
        _expect_value_error(tree_attention_mask, bad, what=f"tree_attention_mask({bad})")


def test_tree_attention_gives_each_node_its_path_alone():
    """Why the mask: one attention over the whole tree (the context's keys, then the nodes')
    gives every node the output it has when its own root-to-node path is run alone."""
    parents = _from_choices(MEDUSA_LIKE)
    n, ctx, D = len(parents), 5, 8
    g = torch.Generator().manual_seed(0)
    k_ctx, v_ctx = torch.randn(ctx, D, generator=g, dtype=torch.float64), torch.randn(ctx, D, generator=g,
                                                                                      dtype=torch.float64)
    q, k, v = (torch.randn(n, D, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.as_tensor(tree_attention_mask(list(parents)), dtype=torch.bool)
    allowed = torch.cat([torch.ones(n, ctx, dtype=torch.bool), mask], dim=1)
    together = F.scaled_dot_product_attention(q[None], torch.cat([k_ctx, k])[None], torch.cat([v_ctx, v])[None],
                                              attn_mask=allowed[None])[0]
    for node, path in enumerate(_paths(parents)):
        keys, values = torch.cat([k_ctx, k[path]]), torch.cat([v_ctx, v[path]])
        alone = F.scaled_dot_product_attention(q[node][None, None], keys[None], values[None])[0, 0]
        adapters.expect_that(torch.allclose(together[node], alone, atol=1e-10), f"attention of node {node} "
                             f"under your mask", f"the output of its path {path} run alone",
                             f"a difference of {float((together[node] - alone).abs().max()):.3g}")


# ---------------------------------------------------------------- longest_accepted_path


def _path_oracle(parents, tokens, target_tokens) -> list[int]:
    """The deepest node whose every step from the root matches the target (unique: siblings differ)."""
    ok = [n == 0 or tokens[n] == target_tokens[parents[n]] for n in range(len(parents))]
    paths = [p for p in _paths(parents) if all(ok[m] for m in p)]
    return max(paths, key=len)


def _check_path(parents, tokens, target, want, what):
    __tracebackhide__ = True
    got = longest_accepted_path(list(parents), list(tokens), list(target))
    adapters.expect_that(isinstance(got, (list, tuple)), what, "a list of node indices", type(got).__name__)
    adapters.expect_all([int(n) for n in got], want, what)


def test_longest_accepted_path_example():
    """The docstring's example: the root's target token is node 2's, a leaf: the path is [0, 2]."""
    _check_path([-1, 0, 0, 1], [7, 10, 11, 20], [11, 5, 20, 6], [0, 2],
                "longest_accepted_path([-1, 0, 0, 1], tokens [7, 10, 11, 20], targets [11, 5, 20, 6])")


def test_longest_accepted_path_by_hand():
    """Contract: from the root, move to the child whose token is the current node's target token while there
    is one; the nodes visited, root first ([0] when no child of the root matches)."""
    parents = _from_choices(MEDUSA_LIKE)  # [-1, 0, 0, 0, 1, 1, 2, 4]
    tokens = [7, 10, 11, 12, 20, 21, 20, 30]
    cases = [  # (target tokens, path, why)
        ([99, 20, 20, 0, 30, 0, 0, 0], [0], "no child of the root holds 99: the root alone"),
        ([10, 21, 0, 0, 0, 0, 0, 0], [0, 1, 5], "10 -> node 1, 21 -> node 5, a leaf"),
        ([10, 20, 0, 0, 30, 0, 0, 5], [0, 1, 4, 7], "all the way down to node 7"),
        ([11, 20, 20, 0, 0, 0, 0, 0], [0, 2, 6], "11 -> node 2, then 20 -> node 6 (node 4 also holds 20, "
                                                 "but under node 1)"),
        ([12, 20, 20, 30, 30, 0, 0, 0], [0, 3], "node 3 has no children: stop there"),
        ([10, 22, 0, 0, 30, 0, 0, 0], [0, 1], "node 1's target token 22 is none of its children's"),
    ]
    for target, want, why in cases:
        _check_path(parents, tokens, target, want, f"longest_accepted_path, targets {target} [{why}]")


@pytest.mark.exercises(points=2)
@pytest.mark.parametrize("seed", range(6))
def test_longest_accepted_path_random_trees(seed):
    """Contract: the walk, on random trees whose target agrees with a child most of the time."""
    rng = random.Random(seed)
    parents = _random_parents([6, 6, 15, 15, 40, 40][seed], seed + 10)  # small trees first
    kids = _children(parents)
    tokens = [rng.randrange(50)] + [0] * (len(parents) - 1)
    for n, cs in enumerate(kids):
        for c, tok in zip(cs, rng.sample(range(50), len(cs))):  # siblings: distinct tokens
            tokens[c] = tok
    # The target agrees with one of the children most of the time, so the walk goes deep.
    target = [tokens[rng.choice(cs)] if cs and rng.random() < 0.85 else 50 + rng.randrange(5) for cs in kids]
    _check_path(parents, tokens, target, _path_oracle(parents, tokens, target),
                f"longest_accepted_path(random tree of {len(parents)} nodes, seed {seed})")


def test_longest_accepted_path_rejects_lists_of_different_lengths():
    """Contract: lists of different lengths -> ValueError."""
    _expect_value_error(longest_accepted_path, [-1, 0, 0], [7, 10, 11], [10, 0],
                        what="longest_accepted_path(3 parents, 3 tokens, 2 target tokens)")


# ---------------------------------------------------------------- multi_candidate_rule


def _dist(V: int, seed: int, zero_frac: float = 0.3) -> torch.Tensor:
    """A random float64 distribution over V tokens, some of them exactly 0."""
    g = torch.Generator().manual_seed(seed)
    logits = 2 * torch.randn(V, generator=g, dtype=torch.float64)
    zeros = torch.rand(V, generator=g) < zero_frac
    zeros[0] = False
    return logits.masked_fill(zeros, float("-inf")).softmax(-1)


def _rule_oracle(p: torch.Tensor, children: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule as the docstring tells it, one child after the other."""
    residual, here = p.clone(), 1.0  # here: the probability that the walk is still trying children
    move = []
    for x in children:
        accept = float(residual[x])  # the draft is one-hot on x: accept with min(1, r(x) / 1)
        move.append(here * accept)
        here *= 1 - accept
        residual = (residual - F.one_hot(torch.tensor(x), len(p)).double()).clamp(min=0)
        residual = residual / residual.sum() if residual.sum() > 0 else p.clone()
    return torch.tensor(move, dtype=torch.float64), residual


def _check_rule(p, children, what, want=None):
    __tracebackhide__ = True
    out = multi_candidate_rule(p.clone(), list(children))
    adapters.expect_that(isinstance(out, tuple) and len(out) == 2, what, "a tuple (move, residual)",
                         type(out).__name__)
    move, residual = (torch.as_tensor(t) for t in out)
    adapters.expect((tuple(move.shape), tuple(residual.shape)), ((len(children),), tuple(p.shape)),
                    f"{what}: (move shape, residual shape)")
    adapters.expect((move.dtype, residual.dtype), (p.dtype, p.dtype), f"{what}: (move dtype, residual dtype), "
                                                                      f"p's (torch.tensor of floats is float32)")
    want_move, want_residual = want if want is not None else _rule_oracle(p, children)
    if not torch.allclose(move.double(), want_move, atol=1e-9, rtol=0):
        j = int((move.double() - want_move).abs().argmax())
        pytest.fail(f"{what}: move[{j}] (child token {children[j]}): expected {float(want_move[j]):.6g} "
                    f"(the target's probability of that token), got {float(move[j]):.6g}", pytrace=False)
    if not torch.allclose(residual.double(), want_residual, atol=1e-9, rtol=0):
        t = int((residual.double() - want_residual).abs().argmax())
        pytest.fail(f"{what}: residual[{t}]: expected {float(want_residual[t]):.6g} (p without the children's "
                    f"tokens, renormalized), got {float(residual[t]):.6g}", pytrace=False)
    return move.double(), residual.double()


def test_multi_candidate_rule_example():
    """The docstring's example: move[j] is p(x_j); the residual is p without the children's tokens, renormalized."""
    p = torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64)
    want = (torch.tensor([0.3, 0.5], dtype=torch.float64), torch.tensor([0.0, 0.0, 1.0, 0.0], dtype=torch.float64))
    _check_rule(p, [1, 0], "multi_candidate_rule(p = [0.5, 0.3, 0.2, 0], children [1, 0])", want)


@pytest.mark.exercises(points=2)
@pytest.mark.parametrize("m", [1, 2, 3, 5])
def test_multi_candidate_rule_moves_with_the_targets_probability(m):
    """Contract: move[j] = p(x_j), in p's dtype; sum_j move[j] one_hot(x_j) + (1 - sum_j move[j]) residual == p."""
    for seed in range(4):
        p = _dist(12, seed=100 * m + seed)
        children = random.Random(seed).sample(range(12), m)
        what = f"multi_candidate_rule(p [12] seed {100 * m + seed}, children {children})"
        move, residual = _check_rule(p, children, what)
        mixed = residual * (1 - move.sum())
        mixed[children] += move
        adapters.expect_that(torch.allclose(mixed, p, atol=1e-9), f"{what}: sum_j move[j] one_hot(x_j) + "
                             f"(1 - sum move) residual", "p itself (the rule is exact)",
                             f"off by {float((mixed - p).abs().max()):.3g}")


def test_multi_candidate_rule_order_does_not_change_the_moves():
    """Contract: the move into a child is p(x_j), whatever the order the children are tried in."""
    p = _dist(10, seed=7, zero_frac=0.0)
    a, _ = _check_rule(p, [3, 8, 1], "multi_candidate_rule(p [10], children [3, 8, 1])")
    b, _ = _check_rule(p, [1, 3, 8], "multi_candidate_rule(p [10], children [1, 3, 8])")
    adapters.expect_that(torch.allclose(a[[2, 0, 1]], b, atol=1e-12), "the move into each child, children tried "
                         "in another order", "the same p(x) for each token", f"{a.tolist()} and {b.tolist()}")


def test_multi_candidate_rule_leaf_and_full_children():
    """Contract: a leaf (m = 0) has no moves and the residual p; if the children hold all of p, the residual is p."""
    p = _dist(8, seed=3)
    _check_rule(p, [], "multi_candidate_rule(p [8], no children: a leaf)",
                (torch.zeros(0, dtype=torch.float64), p))
    q = torch.tensor([0.0, 0.6, 0.0, 0.4], dtype=torch.float64)  # the children hold all the mass
    _check_rule(q, [3, 1], "multi_candidate_rule(p = [0, 0.6, 0, 0.4], children [3, 1]: no mass left, "
                           "the residual is p itself)", (torch.tensor([0.4, 0.6], dtype=torch.float64), q))


def test_multi_candidate_rule_greedy():
    """Contract with a one-hot p (greedy): move[j] = p(x_j), 1 for the argmax child; the residual is p itself when
    the children hold all of it, else p without them, renormalized (the argmax)."""
    p = F.one_hot(torch.tensor(4), 6).double()  # temperature 0: the target's argmax is 4
    _check_rule(p, [2, 4, 0], "multi_candidate_rule(one-hot on 4, children [2, 4, 0]): follow the argmax child",
                (torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64), p))
    _check_rule(p, [2, 0], "multi_candidate_rule(one-hot on 4, children [2, 0]): no child is the argmax, emit it",
                (torch.zeros(2, dtype=torch.float64), p))


def _next_dist(context: tuple[int, ...], V: int) -> torch.Tensor:
    """The 'target model' of the exactness test: a distribution for every context."""
    return _dist(V, seed=hash(context) % 10_000 + 17, zero_frac=0.2)


@pytest.mark.exercises(points=2)
def test_multi_candidate_rule_walk_emits_the_targets_distribution():
    """The walk over a tree, with your rule at every node, emits its first two tokens with
    exactly the target's joint distribution p(t1) p(t2 | t1), worked out by enumeration."""
    V = 6
    # root -> children holding tokens 2, 0, 5; under 2: 1, 4; under 0: 3 (tokens of one node's children differ)
    tree = {(): [2, 0, 5], (2,): [1, 4], (0,): [3], (5,): []}
    joint = torch.zeros(V, V, dtype=torch.float64)
    p_root = _next_dist((), V)
    move, residual = (torch.as_tensor(t).double() for t in multi_candidate_rule(p_root.clone(), tree[()]))
    for t1 in range(V):  # the walk stops at the root and emits t1: the next step samples t2 from the target
        joint[t1] += (1 - move.sum()) * residual[t1] * _next_dist((t1,), V)
    for j, x in enumerate(tree[()]):  # the walk moves into child x: it emits x, then the child's rule decides
        p_child = _next_dist((x,), V)
        m2, r2 = (torch.as_tensor(t).double() for t in multi_candidate_rule(p_child.clone(), tree[(x,)]))
        joint[x] += move[j] * (1 - m2.sum()) * r2
        for k, y in enumerate(tree[(x,)]):
            joint[x, y] += move[j] * m2[k]
    want = p_root[:, None] * torch.stack([_next_dist((t,), V) for t in range(V)])
    tv = 0.5 * float((joint - want).abs().sum())
    adapters.expect_that(tv < 1e-9, "the joint distribution of the walk's first two tokens, your rule at every "
                         "node", "the target's p(t1) p(t2 | t1) (total variation 0)", f"total variation {tv:.3g}")


# ---------------------------------------------------------------- expected_tokens_per_tree


def _expected_oracle(parents, move) -> float:
    total = 0.0
    for path in _paths(parents):
        reach = 1.0
        for n in path[1:]:
            reach *= move[n]
        total += reach
    return total


def test_expected_tokens_per_tree_example():
    """The docstring's example: 1 for the root plus, for each node, the product of the moves on its path."""
    got = expected_tokens_per_tree([-1, 0, 0, 1], [0.0, 0.5, 0.2, 0.6])
    adapters.expect_that(isinstance(got, float) and abs(got - 2.0) < 1e-12,
                         "expected_tokens_per_tree([-1, 0, 0, 1], [-, 0.5, 0.2, 0.6])",
                         "1 + 0.5 + 0.2 + 0.5 * 0.6 = 2.0", got)


def test_expected_tokens_per_tree_chain_is_chapter_5s_formula():
    """Contract: for a chain with every move alpha it is 1 + alpha + ... + alpha^k."""
    for alpha, k in [(0.0, 3), (0.5, 4), (0.8, 6), (1.0, 5)]:
        got = expected_tokens_per_tree(list(range(-1, k)), [1.0] + [alpha] * k)
        want = sum(alpha ** i for i in range(k + 1))
        adapters.expect_that(abs(got - want) < 1e-12, f"expected_tokens_per_tree(a chain of {k}, moves {alpha})",
                             f"1 + alpha + ... + alpha^k = {want!r}", got)


@pytest.mark.parametrize("seed", range(3))
def test_expected_tokens_per_tree_random_trees(seed):
    """Contract: the sum over all nodes of the probability that the walk reaches them."""
    rng = random.Random(seed)
    parents = _random_parents(20, seed + 40)
    move = [1.0] + [0.0] * 20
    for cs in _children(parents):  # moves of one node's children sum to at most 1
        shares = [rng.random() for _ in cs] + [rng.random()]
        for c, s in zip(cs, shares):
            move[c] = s / sum(shares)
    got = expected_tokens_per_tree(parents, move)
    want = _expected_oracle(parents, move)
    adapters.expect_that(abs(got - want) < 1e-9, f"expected_tokens_per_tree(random tree of 21 nodes, seed {seed})",
                         f"{want!r} (the sum over nodes of the product of the moves on the path)", got)


def test_expected_tokens_per_tree_moves_summing_to_one_up_to_rounding():
    """Contract: the moves of one node's children may sum to 1 (allow 1e-9 for rounding)."""
    moves = [1.0, 0.56, 0.34, 0.1]  # 0.56 + 0.34 + 0.1 is 1.0000000000000002 in floating point
    what = ("expected_tokens_per_tree([-1, 0, 0, 0], [-, 0.56, 0.34, 0.1]) (the children's moves sum to 1 "
            "up to rounding)")
    try:
        got = expected_tokens_per_tree([-1, 0, 0, 0], moves)
    except ValueError as e:
        got = f"ValueError: {e}"
    adapters.expect_that(isinstance(got, float) and abs(got - 2.0) < 1e-12, what, "1 + 0.56 + 0.34 + 0.1 = 2.0", got)


def test_expected_tokens_per_tree_rejects_bad_input():
    """Contract: ValueError for lists of different lengths, a parent not in [0, n), a move outside [0, 1], or
    the moves of one node's children summing to more than 1."""
    for args, why in [(([-1, 0], [1.0, 0.5, 0.5]), "lists of different lengths"),
                      (([-1, 1], [1.0, 0.5]), "a parent not before its node"),
                      (([-1, 0], [1.0, 1.5]), "a move above 1"),
                      (([-1, 0], [1.0, -0.1]), "a negative move"),
                      (([-1, 0, 0], [1.0, 0.7, 0.6]), "the root's children's moves sum to 1.3")]:
        _expect_value_error(expected_tokens_per_tree, *args, what=f"expected_tokens_per_tree{args} ({why})")


# ---------------------------------------------------------------- in the engine: a Medusa tree on a tiny model


TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 0, 1)]


def _tiny():
    from minillm import loader
    from minillm.config import ModelConfig

    cfg = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=256)
    # Every matrix x10: at the dummy weights' std its greedy output repeats one token; here it wanders.
    weights = {k: (v * 10 if v.dim() == 2 else v) for k, v in loader.dummy_weights(cfg, seed=0).items()}
    return cfg, weights


def _engine(tiny, **kwargs):
    from minillm.config import EngineConfig
    from minillm.engine import build_engine

    cfg, weights = tiny
    opts = dict(engine="paged", device="cpu", dtype="float32", max_model_len=256, block_size=8, max_num_seqs=4,
                seed=0) | kwargs
    return build_engine(EngineConfig(**opts), weights=weights, model_config=cfg, tokenizer=None)


class _SecondBest(torch.nn.Module):
    """Heads whose right token ranks second on heads 0 and 2: the accepted paths go through
    nodes that are not first children, where a wrong mask shows."""

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


def _tree_engine(tiny, heads, second_best=True, **kwargs):
    engine = _engine(tiny, speculative={"method": "medusa", "heads": heads, "tree": TREE,
                                        "disable_by_batch_size": None}, **kwargs)
    if second_best:
        engine.speculator.drafter.heads = _SecondBest(engine.speculator.drafter.heads)
    return engine


def _run(engine, prompts, temperature=0.0):
    from minillm import SamplingParams

    params = [SamplingParams(temperature=temperature, max_tokens=24, ignore_eos=True,
                             seed=None if temperature == 0 else 11 + i) for i in range(len(prompts))]
    outs = engine.run([engine.make_request(p, sp) for p, sp in zip(prompts, params)])
    schedule = [(tuple(s.request_ids), tuple(s.num_new_tokens)) for s in engine.step_records]
    return [o.token_ids for o in outs], schedule


@functools.lru_cache(maxsize=1)
def _fitted_medusa():
    """The tiny model, its greedy continuations of four prompts, and Medusa heads fitted to
    them (they draft what the target will say, so trees are accepted deep). Fitted once a
    process: the engines only read the heads."""
    from minillm import loader
    from minillm.spec_decode.medusa import MedusaHeads, head_positions

    tiny = _tiny()
    cfg, weights = tiny
    prompts = [[(7 * i + 3 * j) % 120 + 4 for j in range(5 + 9 * i)] for i in range(4)]
    want, _ = _run(_engine(tiny), prompts)
    hf = loader.hf_model_from_weights(weights, cfg, torch.float32)
    seqs = [p + o for p, o in zip(prompts, want)]
    with torch.inference_mode():
        hidden = [hf.model(input_ids=torch.tensor([s])).last_hidden_state[0].clone() for s in seqs]
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
    return tiny, prompts, want, heads


@pytest.fixture(scope="module")
def medusa():
    return _fitted_medusa()


def _spy(fn, calls: list):
    def call(*args):
        calls.append(1)
        return fn(*args)

    return call


@pytest.mark.exercises(points=2)
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_tree_attention_mask_in_the_engine(medusa, backend):
    """In the engine: with your mask, the Medusa tree engine gives plain greedy decoding's tokens and the
    library's step schedule."""
    tiny, prompts, want, heads = medusa
    library = _tree_engine(tiny, heads, attention_backend=backend)
    _, lib_schedule = _run(library, prompts)
    assert library.spec_stats.tokens_per_target_forward > 2, "the fitted heads must be accepted deep"
    calls: list = []
    engine = _tree_engine(tiny, heads, attention_backend=backend)
    with seams.plug(tree_attention_mask=_spy(tree_attention_mask, calls)):
        tokens, schedule = _run(engine, prompts)
    adapters.expect_that(len(calls) > 0, f"the Medusa tree engine ({backend} attention) with your "
                         "tree_attention_mask plugged in", "calls to it", "none")
    adapters.expect(tokens, want, f"greedy tokens of the tree engine ({backend} attention) with your "
                                  "tree_attention_mask, against plain decoding's")
    adapters.expect(schedule, lib_schedule, "the step schedule (requests, tokens fed) with your "
                                            "tree_attention_mask, against the library's tree engine")


@pytest.mark.exercises(points=2)
def test_longest_accepted_path_in_the_engine(medusa):
    """In the engine: with your walk, the Medusa tree engine gives plain greedy decoding's tokens, the library's
    step schedule and as many accepted drafts."""
    tiny, prompts, want, heads = medusa
    library = _tree_engine(tiny, heads, attention_backend="cpu")
    _, lib_schedule = _run(library, prompts)
    calls: list = []
    engine = _tree_engine(tiny, heads, attention_backend="cpu")
    with seams.plug(longest_accepted_path=_spy(longest_accepted_path, calls)):
        tokens, schedule = _run(engine, prompts)
    adapters.expect_that(len(calls) > 0, "the tree engine with your longest_accepted_path plugged in",
                         "calls to it", "none")
    adapters.expect(tokens, want, "greedy tokens of the tree engine with your longest_accepted_path, against "
                                  "plain decoding's")
    adapters.expect(schedule, lib_schedule, "the step schedule with your longest_accepted_path, against the "
                                            "library's tree engine (a path cut short emits fewer tokens a step)")
    adapters.expect(engine.spec_stats.num_accepted, library.spec_stats.num_accepted,
                    "drafts accepted with your longest_accepted_path, against the library's")


@pytest.mark.exercises(points=2)
def test_multi_candidate_rule_in_the_engine_is_plain_sampling(medusa):
    """Seeded sampling: the tree walk with your rule at every node gives, token for token, what
    plain sampling gives with the same seeds (an exact rule draws each position's token from
    the target's distribution with that position's noise)."""
    tiny, prompts, _, heads = medusa
    plain, _ = _run(_engine(tiny), prompts, temperature=0.9)
    library = _tree_engine(tiny, heads, second_best=False, attention_backend="cpu")
    lib_tokens, lib_schedule = _run(library, prompts, temperature=0.9)
    assert lib_tokens == plain and library.spec_stats.num_accepted > 0
    calls: list = []
    engine = _tree_engine(tiny, heads, second_best=False, attention_backend="cpu")
    with seams.plug(multi_candidate_rule=_spy(multi_candidate_rule, calls)):
        tokens, schedule = _run(engine, prompts, temperature=0.9)
    adapters.expect_that(len(calls) > 0, "the tree engine with your multi_candidate_rule plugged in",
                         "calls to it", "none")
    adapters.expect(tokens, plain, "sampled tokens (temperature 0.9, seeded) of the tree engine with your "
                                   "multi_candidate_rule, against plain sampling's with the same seeds")
    adapters.expect(schedule, lib_schedule, "the step schedule with your multi_candidate_rule, against the "
                                            "library's tree engine")


# ---------------------------------------------------------------- questions


@pytest.mark.parametrize("qid", [q.qid for q in quiz.questions(CHAPTER)])
def test_quiz(qid):
    """The chapter's questions: each answer as the question asks for it."""
    answers = quiz_answers()
    assert isinstance(answers, dict), f"quiz_answers() must return a dict of answers, got {type(answers).__name__}"
    ok, why = quiz.check(CHAPTER, qid, answers.get(qid))
    assert ok, why
