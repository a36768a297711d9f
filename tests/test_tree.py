"""Candidate trees (minillm/spec_decode/tree.py): the shape, the attention mask, and the
acceptance rules, exact and typical, against exact enumeration and plain sampling."""
import itertools

import pytest
import torch
import torch.nn.functional as F

from minillm import SamplingParams
from minillm.bench import exactness as ex
from minillm.spec_decode import tree as T

MEDUSA_LIKE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


def test_build_tree_numbers_parents_before_children():
    t = T.build_tree(reversed(MEDUSA_LIKE))  # order given does not matter
    assert t.choices == ((), (0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert t.parents == (-1, 0, 0, 0, 1, 1, 2, 4)
    assert t.depths == (0, 1, 1, 1, 2, 2, 2, 3)
    assert t.ranks == (-1, 0, 1, 2, 0, 1, 0, 0)
    assert (t.num_nodes, t.depth, t.width) == (8, 3, 3)
    assert t.children(1) == [4, 5] and t.children(3) == []
    assert T.chain(3).parents == (-1, 0, 1, 2)


@pytest.mark.parametrize("choices, message", [
    ([], "at least one choice"),
    ([()], "non-empty"),
    ([(0,), (0,)], "given twice"),
    ([(0,), (-1,)], ">= 0"),
    ([(0,), (1, 0)], "add (1,)"),
])
def test_build_tree_rejects_bad_choices(choices, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        T.build_tree(choices)


def test_candidate_tokens_read_each_heads_ranking():
    t = T.build_tree(MEDUSA_LIKE)
    ranking = torch.tensor([[10, 11, 12], [20, 21, 22], [30, 31, 32]])
    assert T.candidate_tokens(t, 7, ranking).tolist() == [7, 10, 11, 12, 20, 21, 20, 30]
    with pytest.raises(ValueError, match="head_ranking"):
        T.candidate_tokens(t, 7, ranking[:2])


def test_mask_is_ancestor_or_self():
    t = T.build_tree(MEDUSA_LIKE)
    mask = T.tree_attention_mask(t.parents)
    for i, j in itertools.product(range(t.num_nodes), repeat=2):
        # j is an ancestor-or-self of i iff j's choice is a prefix of i's
        assert bool(mask[i, j]) == (t.choices[i][:len(t.choices[j])] == t.choices[j]), (i, j)
    assert T.tree_positions(t.depths, 40).tolist() == [40, 41, 41, 41, 42, 42, 42, 43]


def _tree_attention(q, k, v, ctx_len, mask):
    """Queries of the N+1 nodes over the context's keys plus the nodes' keys, under the tree mask."""
    n = mask.shape[0]
    allowed = torch.cat([torch.ones(n, ctx_len, dtype=torch.bool), mask], dim=1)  # [n, ctx + n]
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=allowed[None])[0]


def _mutated_masks(mask):
    chain_mask = torch.ones_like(mask).tril()  # siblings' branches visible: a chain's causal mask
    diagonal = torch.eye(mask.shape[0], dtype=torch.bool)  # no ancestors
    no_root = mask.clone()
    no_root[1:, 0] = False  # forgets the root
    return {"chain (causal) mask": chain_mask, "self only": diagonal, "root not visible": no_root}


def test_tree_attention_equals_each_path_run_alone_and_mutations_do_not():
    """One attention over the whole tree gives every node the output it has when its own
    root-to-node path is run alone with a causal mask -- and a wrong mask does not."""
    torch.manual_seed(0)
    t = T.build_tree(MEDUSA_LIKE)
    ctx_len, D = 5, 8
    kv_ctx = torch.randn(2, ctx_len, D)  # the context's keys and values (the paged cache)
    qkv_nodes = torch.randn(3, t.num_nodes, D)  # each node's query, key, value
    mask = T.tree_attention_mask(t.parents)

    def alone(node):
        path, n = [], node
        while n >= 0:
            path.append(n)
            n = t.parents[n]
        path = path[::-1]
        q = qkv_nodes[0, path]
        k = torch.cat([kv_ctx[0], qkv_nodes[1, path]])
        v = torch.cat([kv_ctx[1], qkv_nodes[2, path]])
        causal = torch.cat([torch.ones(len(path), ctx_len, dtype=torch.bool),
                            torch.ones(len(path), len(path), dtype=torch.bool).tril()], dim=1)
        return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=causal[None])[0, -1]

    def run(m):
        k = torch.cat([kv_ctx[0], qkv_nodes[1]])
        v = torch.cat([kv_ctx[1], qkv_nodes[2]])
        return _tree_attention(qkv_nodes[0], k, v, ctx_len, m)

    expected = torch.stack([alone(n) for n in range(t.num_nodes)])
    torch.testing.assert_close(run(mask), expected)
    for name, wrong in _mutated_masks(mask).items():
        assert not torch.allclose(run(wrong), expected, atol=1e-4), name


def _toy(temperature, seed=0, V=6):
    tl = ex.toy_logits_model(V, seed, scale=1.5)
    dl = ex.toy_logits_model(V, seed + 1, scale=1.5, base=tl)
    sp = SamplingParams(temperature=temperature)
    return ex.toy_probs_model(tl, sp), ex.toy_probs_model(dl, sp)


def _residual_keeps_children(tree, tokens, p):
    """Wrong: on stopping, sample p itself -- the children's tokens get their mass twice."""
    move, _ = T.exact_tree_rule(tree, tokens, p)
    return move, p.to(move.dtype)


def _first_child_only(tree, tokens, p):
    """Wrong: only the best-ranked child is ever tried, but all are removed from the residual."""
    move, emit = T.exact_tree_rule(tree, tokens, p)
    for n in range(tree.num_nodes):
        for c in tree.children(n)[1:]:
            move[c] = 0.0
    return move, emit


@pytest.mark.parametrize("temperature", [0.0, 0.8, 1.0])
def test_exact_rule_enumerates_to_the_target_and_wrong_rules_do_not(temperature):
    target, draft = _toy(temperature)
    tree = T.build_tree(MEDUSA_LIKE)
    ranking = ex.toy_ranking(draft, tree.depth, tree.width)
    m = 3
    exact = ex.target_distribution(target, m)
    spec = ex.enumerate_tree_output_distribution(target, ranking, tree, T.exact_tree_rule, m)
    assert ex.max_abs_difference(spec, exact) < 1e-12
    if temperature == 0:
        return  # greedy: p one-hot, every rule is the argmax walk
    for name, rule in {"typical acceptance": T.typical_tree_rule, "residual keeps children": _residual_keeps_children,
                       "first child only": _first_child_only}.items():
        wrong = ex.enumerate_tree_output_distribution(target, ranking, tree, rule, m)
        assert abs(sum(wrong.values()) - 1) < 1e-9, name
        assert ex.total_variation(wrong, exact) > 0.05, name


def test_typical_is_exact_for_greedy_and_its_bar():
    target, draft = _toy(0.0)
    tree = T.build_tree(MEDUSA_LIKE)
    ranking = ex.toy_ranking(draft, tree.depth, tree.width)
    spec = ex.enumerate_tree_output_distribution(target, ranking, tree, T.typical_tree_rule, 3)
    assert ex.max_abs_difference(spec, ex.target_distribution(target, 3)) < 1e-12
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    # H = ln 2 -> delta * exp(-H) = 0.15 > epsilon 0.09; H = 0 -> min(0.09, 0.3)
    torch.testing.assert_close(T.typical_threshold(p, 0.09, 0.3), torch.tensor([0.09, 0.09], dtype=torch.float64))
    torch.testing.assert_close(T.typical_threshold(p, 0.5, 0.3), torch.tensor([0.15, 0.3], dtype=torch.float64))


@pytest.mark.parametrize("temperature", [0.8, 1.0])
def test_exact_walk_is_plain_sampling_token_for_token(temperature):
    target, draft = _toy(temperature, seed=3)
    tree = T.build_tree(MEDUSA_LIKE)
    ranking = ex.toy_ranking(draft, tree.depth, tree.width)
    spec, tokens_per_round = ex.sample_tree_coupled(target, ranking, tree, n=300, m=4, seed=11)
    assert torch.equal(spec, ex.sample_plain_at(target, 300, 4, seed=11))
    assert tokens_per_round > 1.3  # the tree did accept drafts: the equality is not the trivial one


def test_sampled_test_passes_exact_and_fails_typical():
    """The statistical test on samples, as on the real model: the exact walk passes both the
    TV threshold and the chi-square test; typical acceptance, accepting more, fails both."""
    target, draft = _toy(1.0, seed=5)
    tree = T.build_tree(MEDUSA_LIKE)
    ranking = ex.toy_ranking(draft, tree.depth, tree.width)
    n, m = 1500, 2
    exact = ex.target_distribution(target, m)
    threshold = ex.tv_threshold(n, len(exact), two_sample=False)
    rows = {}
    for rule in ("exact", "typical"):
        samples, per_round = ex.sample_tree_coupled(target, ranking, tree, n, m, seed=100, rule=rule)
        cells, counts = torch.unique(samples, dim=0, return_counts=True)
        freq = {tuple(c): v / n for c, v in zip(cells.tolist(), counts.tolist())}
        rows[rule] = (ex.total_variation(freq, exact), ex.chi_square_p_value(samples, exact), per_round)
    assert rows["exact"][0] < threshold and rows["exact"][1] > 1e-3, rows
    assert rows["typical"][0] > threshold and rows["typical"][1] < 1e-6, rows
    assert rows["typical"][2] > rows["exact"][2], rows  # it accepts more: that is its appeal


def test_chi_square_p_value():
    exact = {(0,): 0.5, (1,): 0.3, (2,): 0.2}
    fair = torch.tensor([[0]] * 500 + [[1]] * 300 + [[2]] * 200)
    assert ex.chi_square_p_value(fair, exact) == pytest.approx(1.0)
    skewed = torch.tensor([[0]] * 560 + [[1]] * 260 + [[2]] * 180)  # chi2 = 7.2 + 5.33 + 2 = 14.53, df 2
    assert ex.chi_square_p_value(skewed, exact) == pytest.approx(0.000699, rel=1e-2)
    assert ex.chi_square_p_value(torch.tensor([[3]]), exact) == 0.0  # a cell of probability 0


def test_accepted_path_is_the_longest_matching_path():
    torch.manual_seed(1)
    tree = T.build_tree(MEDUSA_LIKE)
    for _ in range(200):
        tokens = torch.randint(0, 3, (tree.num_nodes,))
        for n in range(tree.num_nodes):  # siblings distinct, as one head's ranking gives them
            kids = tree.children(n)
            tokens[kids] = torch.randperm(4)[:len(kids)]
        target = torch.randint(0, 4, (tree.num_nodes,))
        path = T.accepted_path(tree, tokens, target)
        best = 0
        for node in range(tree.num_nodes):  # brute force: every node whose whole path matches
            ok, n = True, node
            while tree.parents[n] >= 0:
                ok &= int(tokens[n]) == int(target[tree.parents[n]])
                n = tree.parents[n]
            if ok:
                best = max(best, tree.depths[node])
        assert len(path) - 1 == best
