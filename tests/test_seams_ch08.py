"""Chapter 8's seams: a learner's tree mask, accepted path and multi-candidate rule, plugged
into the runner's mask bits and the tree walk.

With the reference answers plugged, every number is the library's: the same mask bits for
every tree, the same accepted nodes and emitted tokens for every walk (greedy and sampled,
the same noise). The rule, when plugged, decides the walk (the path seam is then not asked);
typical acceptance asks neither. An answer of the wrong shape is a ValueError that says
what was expected. (The engine runs with them: tests/exercises/test_ch08_model_drafts_itself.py.)
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from minillm import seams
from minillm.model_runner import tree_mask_bits
from minillm.spec_decode import tree as T

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import solutions.ch08_model_drafts_itself as s08  # noqa: E402

TREES = [T.MEDUSA_TREE, [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)], [(0,), (0, 0), (0, 0, 0)], [(0,)]]


def spy(fn, calls: list):
    def call(*args):
        calls.append(args)
        return fn(*args)

    return call


def test_the_seams_name_chapter_8():
    for name in ("tree_attention_mask", "longest_accepted_path", "multi_candidate_rule"):
        assert seams.SEAMS[name].chapter == "ch08_model_drafts_itself"
        assert callable(getattr(s08, name))


@pytest.mark.parametrize("choices", TREES, ids=["medusa", "medusa-like", "chain", "one"])
def test_reference_mask_gives_the_runners_bits(choices):
    tree = T.build_tree(choices)
    calls = []
    with seams.plug(tree_attention_mask=spy(s08.tree_attention_mask, calls)):
        bits = tree_mask_bits(tree)
        prefix = tree_mask_bits(tree.prefix(1))  # a step with room for fewer drafts verifies a prefix
    assert bits == tree.ancestor_bits() and prefix == tree.prefix(1).ancestor_bits()
    assert [a[0] for a in calls] == [list(tree.parents), list(tree.prefix(1).parents)]


def test_a_mask_of_the_wrong_shape_is_a_clear_error():
    tree = T.build_tree(TREES[1])
    with seams.plug(tree_attention_mask=lambda parents: torch.ones(3, 3, dtype=torch.bool)), \
            pytest.raises(ValueError, match=r"tree_attention_mask must return \[8, 8\] for 8 nodes"):
        tree_mask_bits(tree)


def _walk_case(seed: int, temperature: float, V: int = 7):
    g = torch.Generator().manual_seed(seed)
    tree = T.build_tree(TREES[1])
    logits = 3 * torch.randn(tree.num_nodes, V, generator=g, dtype=torch.float64)
    p = torch.nn.functional.one_hot(logits.argmax(-1), V).double() if temperature == 0 else \
        (logits / temperature).softmax(-1)
    ranking = torch.stack([torch.randperm(V, generator=g)[:tree.width] for _ in range(tree.depth)])
    tokens = T.candidate_tokens(tree, int(torch.randint(V, (1,), generator=g)), ranking)
    noise = -torch.rand(tree.depth + 1, V, generator=g, dtype=torch.float64).log()
    return tree, tokens, p, noise


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_reference_path_and_rule_give_the_librarys_walk(temperature):
    deep = 0
    for seed in range(40):
        tree, tokens, p, noise = _walk_case(seed, temperature)
        want = T.walk_tree(tree, tokens, p, noise)
        deep += len(want[0]) > 1
        for name in ("longest_accepted_path", "multi_candidate_rule"):
            calls = []
            with seams.plug(**{name: spy(getattr(s08, name), calls)}):
                assert T.walk_tree(tree, tokens, p, noise) == want, (name, seed)
            assert calls, name
    assert deep > 5, "the walks must accept drafts, or the comparison shows little"


def test_the_rule_decides_the_walk_and_typical_acceptance_asks_neither():
    tree, tokens, p, noise = _walk_case(3, 1.0)
    path_calls, rule_calls = [], []
    with seams.plug(longest_accepted_path=spy(s08.longest_accepted_path, path_calls),
                    multi_candidate_rule=spy(s08.multi_candidate_rule, rule_calls)):
        T.walk_tree(tree, tokens, p, noise)
        assert rule_calls and not path_calls
        rule_calls.clear()
        T.walk_tree(tree, tokens, p, noise, rule="typical")
    assert not rule_calls and not path_calls


def test_a_rule_that_keeps_the_children_in_the_residual_changes_the_walk():
    def keeps_children(p, child_tokens):
        move, _ = s08.multi_candidate_rule(p, child_tokens)
        return move, p  # wrong: the children's tokens get their mass twice

    differ = 0
    for seed in range(40):
        tree, tokens, p, noise = _walk_case(seed, 1.0)
        want = T.walk_tree(tree, tokens, p, noise)
        with seams.plug(multi_candidate_rule=keeps_children):
            differ += T.walk_tree(tree, tokens, p, noise) != want
    assert differ > 0


def test_a_rule_of_the_wrong_shape_is_a_clear_error():
    tree, tokens, p, noise = _walk_case(0, 1.0)
    with seams.plug(multi_candidate_rule=lambda p, kids: (torch.zeros(len(kids) + 1), p)), \
            pytest.raises(ValueError, match=r"multi_candidate_rule must return \(move \[3\], residual \[7\]\)"):
        T.walk_tree(tree, tokens, p, noise)


def test_a_mask_that_reads_a_later_node_or_not_itself_stops_the_step():
    tree = T.build_tree(TREES[1])
    n = tree.num_nodes
    for bad, match in [(lambda parents: torch.ones(n, n, dtype=torch.bool), r"mask\[0, 1\] is True"),
                       (lambda parents: s08.tree_attention_mask(parents) & ~torch.eye(n, dtype=torch.bool),
                        r"every node attends to itself.*mask\[0, 0\] is False")]:
        with seams.plug(tree_attention_mask=bad), pytest.raises(seams.SeamContractError, match=match):
            tree_mask_bits(tree)


def test_a_path_the_walk_cannot_take_stops_it():
    tree, tokens, p, noise = _walk_case(0, 0.0)
    kids = [c for c in range(1, tree.num_nodes) if tree.parents[c] == 0]
    grandchild = tree.depths.index(2)
    for bad, match in [(lambda parents, toks, target: [], "the path starts at the root"),
                       (lambda parents, toks, target: [0, grandchild], "a child of the node before it"),
                       (lambda parents, toks, target: [0] + [c for c in kids if toks[c] != target[0]][:1],
                        "its token is the target's token after its parent")]:
        with seams.plug(longest_accepted_path=bad), pytest.raises(seams.SeamContractError, match=match):
            T.walk_tree(tree, tokens, p, noise)


def test_a_rule_whose_numbers_are_not_probabilities_stops_the_walk():
    tree, tokens, p, noise = _walk_case(0, 1.0)
    unnormalized = lambda q, kids: (q[kids], q.index_fill(0, torch.tensor(kids, dtype=torch.long), 0.0))  # noqa: E731
    too_much = lambda q, kids: (torch.full((len(kids),), 0.5, dtype=q.dtype), q)  # noqa: E731
    for bad, match in [(unnormalized, "the residual is a distribution"), (too_much, "at most one child")]:
        with seams.plug(multi_candidate_rule=bad), pytest.raises(seams.SeamContractError, match=match):
            T.walk_tree(tree, tokens, p, noise)
