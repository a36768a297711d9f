"""Chapter 8 exercises: a candidate tree, verified in one forward and walked exactly.

Replace each ``raise NotImplementedError`` with your code, then grade it from the
repository root:

    make grade CHAPTER=ch08          # or: .venv/bin/python tests/grade.py ch08

Each docstring gives the shapes, the contract the tests check, and hints. Once you
have tried, compare with the file of ``minillm/`` named at the end of the docstring.
Plain PyTorch and Python are all you need; do not import the answers from ``minillm``.

Notation: a tree has N + 1 nodes. Node 0 is the **root**, the request's last known token;
nodes 1..N are the candidates, numbered parents before children, so ``parents[0] == -1``
and ``parents[n] < n``. ``tokens[n]`` is node n's token; siblings have distinct tokens
(they are different ranks of one Medusa head).

Three functions are also seams of the library (``minillm/seams.py``): plugged in, yours
decide which nodes each node's query attends to, which nodes a greedy (or sampled) walk
accepts, and the exact rule at every node of the walk of ``LLM(speculative={"method":
"medusa", "tree": ...})``. The chapter's "Run it in the engine" cells do it and check that
the tokens are the library's.
"""
from __future__ import annotations

import torch


def tree_attention_mask(parents: list[int]) -> torch.Tensor:
    """Which nodes of the tree each node's query may attend to: [N+1, N+1] bool.

    Shapes: ``parents``, N + 1 ints (``parents[0] == -1``, the root). Returns a bool tensor
    ``mask`` [N+1, N+1] with ``mask[i, j]`` True iff node j is node i itself or one of its
    ancestors (its parent, its parent's parent, ... up to the root).

    Why: the whole tree is verified in one forward, every node a query row. A node's
    output must be the one it would have if its own path root -> ... -> node were run
    alone, so it reads the keys of its path and of nothing else (not its siblings', not
    their children's). The context before the root is read by every node; the engine
    adds that part itself. For a chain (``parents = [-1, 0, 1, 2]``) the mask is the
    usual causal lower triangle; for a tree it is not.

    Contract: exact, element for element; ``parents[0] != -1`` or any ``parents[n]``
    outside ``[0, n)`` for n >= 1 -> ``ValueError``.

    Example: ``parents = [-1, 0, 0, 1]`` (the root with children 1 and 2, node 3 under 1)::

        [[1, 0, 0, 0],
         [1, 1, 0, 0],
         [1, 0, 1, 0],
         [1, 1, 0, 1]]

    Hints: parents come before children, so row i is row ``parents[i]`` plus node i
    itself: fill the rows in order, ``mask[i] = mask[parents[i]]`` then ``mask[i, i] = True``.

    In the engine: the seam ``tree_attention_mask``. The runner turns your rows into the
    bits the attention kernels read (``model_runner.tree_mask_bits``) at every step that
    verifies a tree: a wrong mask gives the target wrong distributions at the nodes.

    Answer, after you try: ``minillm/spec_decode/tree.py``, ``tree_attention_mask`` (and
    ``minillm/candidate_tree.py``, ``TreeSpec.ancestor_bits``: the same rows as bits).
    """
    raise NotImplementedError


def longest_accepted_path(parents: list[int], tokens: list[int], target_tokens: list[int]) -> list[int]:
    """The nodes the walk accepts, root first, when the target's token after every node is known.

    Shapes: ``parents``, ``tokens``, ``target_tokens``: N + 1 ints each. ``tokens[n]`` is
    node n's token (``tokens[0]`` the root's); ``target_tokens[n]`` is the token the target
    model emits after node n's path (its argmax when greedy, its sample when sampling):
    the forward over the tree gives one for every node at once.

    Contract: start at the root; while the current node has a child c whose token
    ``tokens[c]`` equals ``target_tokens[current]``, move to c; return the nodes visited,
    root first (``[0]`` when no child of the root matches). Siblings have distinct tokens,
    so there is at most one such child. Lists of different lengths -> ``ValueError``.

    The step then emits the tokens of the accepted nodes after the root and one more,
    ``target_tokens[last node]``: ``len(path)`` tokens from one forward. Greedy, the path
    is the longest one whose every token is the target's argmax.

    Example: ``parents = [-1, 0, 0, 1]``, ``tokens = [7, 10, 11, 20]``,
    ``target_tokens = [11, 5, 20, 6]``: the root's target token is 11, node 2's token; node 2
    has no children, so the path is ``[0, 2]`` and the step emits 11, then 20.

    Hints: ``children[n]`` lists in one pass over ``parents``; then a ``while`` loop.

    In the engine: the seam ``longest_accepted_path``. The speculator calls it for every
    tree a step verifies; the accepted nodes' tokens are emitted and their K/V moved to
    the positions their depths give.

    Answer, after you try: ``minillm/spec_decode/tree.py``, ``accepted_path``.
    """
    raise NotImplementedError


def multi_candidate_rule(p: torch.Tensor, child_tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact rule at one node of the tree: move into which child, or emit what.

    Shapes: ``p`` [V], the target's distribution after this node (sums to 1);
    ``child_tokens``: the m distinct tokens x_1..x_m of the node's children, in the
    order they are tried (m may be 0: a leaf). Returns ``(move, residual)``: ``move`` [m]
    and ``residual`` [V], in p's dtype.

    The rule (SpecInfer's multi-candidate rejection sampling, with candidates that are
    certain: each child's "draft distribution" is one-hot on its token): try the children
    in order. Accept x_1 with probability p(x_1). If it is rejected, the target becomes the
    residual norm(max(0, p - one_hot(x_1))) -- p without x_1, renormalized -- and x_2 is
    accepted with its probability under that residual; and so on. If every child is
    rejected, the token emitted is drawn from the last residual.

    Contract:
      - ``move[j]``: the probability that the walk moves into child j (the product of the
        rejections before it and its acceptance). Multiply it out: it is p(x_j), whatever
        the order;
      - ``residual``: the distribution of the token emitted when no child is taken:
        p with the children's tokens set to 0, renormalized; if that leaves no mass (the
        children hold all of p, as when a greedy row's argmax is a child), return p itself:
        the walk then gives the residual weight 0, but a 0 / 0 would put NaN into the draw;
      - together they are exact: sum_j move[j] one_hot(x_j) + (1 - sum_j move[j]) residual
        == p, so the token that comes out of this node is distributed as the target's.

    Example: p = [0.5, 0.3, 0.2, 0.0], children tokens [1, 0]: move = [0.3, 0.5],
    residual = [0, 0, 1, 0].

    Hints: either follow the rule step by step (a loop keeping the current residual and
    the probability of having got this far) or write the closed form; then check one
    against the other. ``p.clone()``, index with ``child_tokens``, ``torch.where`` for the
    case with no mass left.

    In the engine: the seam ``multi_candidate_rule``. Plugged in, the walk asks yours at
    every node it visits, and draws the node's token from your move and residual with the
    step's own noise; an exact rule gives plain sampling's tokens, a wrong one changes them.

    Answer, after you try: ``minillm/spec_decode/tree.py``, ``exact_tree_rule`` (the same
    for every node of a tree at once: ``move`` per node, ``emit`` per node).
    """
    raise NotImplementedError


def expected_tokens_per_tree(parents: list[int], move: list[float]) -> float:
    """The mean number of tokens one verification of the tree emits.

    Shapes: ``parents``, ``move``: N + 1 each. ``move[n]`` (n >= 1) is the probability that
    the walk moves into node n once it has reached n's parent (with the exact rule, the
    target's probability of n's token after the parent); ``move[0]`` is not read (the walk
    always starts at the root).

    Contract: the step emits one token per accepted node after the root plus one, i.e.
    ``len(path)`` tokens, so the mean is the sum over all nodes of the probability that the
    walk reaches them: 1 for the root, and for node n the product of ``move`` along its
    path from the root. For a chain with every move equal to alpha it is
    1 + alpha + ... + alpha^k (chapter 5's ``expected_tokens_per_forward``).
    ``ValueError`` when the lists differ in length, a parent is not in ``[0, n)``, a move
    is outside [0, 1], or the moves of one node's children sum to more than 1 (the walk
    takes at most one child; allow 1e-9 for rounding).

    Example: parents [-1, 0, 0, 1], moves [-, 0.5, 0.2, 0.6]: 1 + 0.5 + 0.2 + 0.5 * 0.6 = 2.0.

    Hints: parents first, so reach[n] = reach[parents[n]] * move[n] in one pass.

    The chapter compares tree shapes with it: the heads' measured accuracy at each rank
    gives the moves, and the tree that emits the most tokens for the rows it costs wins.

    Answer, after you try: no single function: ``minillm/spec_decode/tree.py``,
    ``exact_tree_rule`` gives every node's move; the engine counts what it got in
    ``engine.spec_stats.tokens_per_target_forward``.
    """
    raise NotImplementedError


def quiz_answers() -> dict[str, str | float]:
    """Your answers to this chapter's questions: {"q1": ..., "q2": ...}.

    Print the questions with ``from minillm.course import quiz; quiz.show("ch08")`` (the
    chapter's last cells do it). A choice question takes a letter ("b"); a numeric
    question a number (rounded as the question says before it is compared). Leave a
    question out until you have an answer: it is graded as not answered.
    """
    raise NotImplementedError
