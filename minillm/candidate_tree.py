"""The shape of a candidate tree (speculative decoding, Medusa): plain Python, no torch.

The tree is static, written as Medusa writes it: a list of ``choices``, one tuple per node,
each entry an index into one head's ranking. ``(0,)`` is head 0's top-1, ``(2,)`` its top-3,
``(0, 1)`` head 0's top-1 followed by head 1's top-2. Every prefix of a node is a node.
``build_tree`` numbers the nodes: node 0 is the root (the request's last known token), nodes
1..N follow by depth, then by choice, so a parent always comes before its children.

A leaf of the package (the engine's configuration checks a tree with it); what verifies a
tree -- its attention mask, the acceptance rules, the walk -- is ``minillm.spec_decode.tree``.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

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

    def prefix(self, num_drafts: int) -> "TreeSpec":
        """The tree of the root and the first ``num_drafts`` nodes: still a tree, since parents
        come first. What a step verifies when it has room for fewer drafts than the tree has."""
        if not 1 <= num_drafts <= self.num_nodes - 1:
            raise ValueError(f"a prefix of this tree has 1 .. {self.num_nodes - 1} drafts, got {num_drafts}")
        return self if num_drafts == self.num_nodes - 1 else _prefix(self, num_drafts)

    def ancestor_bits(self) -> list[int]:
        """Per node, its ancestors-or-self among nodes 1..N as bits (bit m - 1 for node m; the
        root's is 0): the row of ``tree_attention_mask`` past the root, as the attention
        kernels read it (``kernels.paged_decode_attention.tree_key_mask``)."""
        bits = [0] * self.num_nodes
        for n in range(1, self.num_nodes):
            bits[n] = bits[self.parents[n]] | (1 << (n - 1))
        return bits


# A tree for weak heads (16 nodes): wide at depth 1 (head 0's top-6), narrower below, one path 4 deep.
# ``LLM(speculative={"method": "medusa", "tree": MEDUSA_TREE})``, ``bench --speculative medusa --medusa-tree``.
MEDUSA_TREE = [(0,), (1,), (2,), (3,), (4,), (5,), (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (3, 0), (0, 0, 0),
               (1, 0, 0), (0, 1, 0), (0, 0, 0, 0)]
MAX_TREE_NODES = 63  # drafts per tree: one bit each in an int64 mask (``TreeSpec.ancestor_bits``)


@lru_cache(maxsize=256)
def _prefix(tree: TreeSpec, num_drafts: int) -> TreeSpec:
    return build_tree(tree.choices[1:num_drafts + 1])


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
    if len(paths) > MAX_TREE_NODES:
        raise ValueError(f"a tree holds at most {MAX_TREE_NODES} choices (drafts), got {len(paths)}")
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


__all__ = ["MAX_TREE_NODES", "MEDUSA_TREE", "TreeSpec", "build_tree", "chain"]
