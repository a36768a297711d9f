"""The n-gram (prompt lookup) drafter: plain Python, so hand-made cases and properties."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.spec_decode.ngram import NgramProposer


def test_copies_what_followed_the_suffix():
    prop = NgramProposer(n_max=3, n_min=1, k=4)
    #            0  1  2  3  4  5  6  7
    tokens = [5, 6, 7, 8, 9, 1, 6, 7]  # suffix [6, 7] occurred at 1, followed by 8, 9, 1, 6
    assert prop.propose(tokens) == [8, 9, 1, 6]
    assert prop.propose(tokens, k=2) == [8, 9]


def test_longest_suffix_wins():
    prop = NgramProposer(n_max=3, n_min=1, k=2)
    # [2] alone last occurred at 3 (followed by 9); the 2-gram [1, 2] occurred at 0 (followed by 7).
    tokens = [1, 2, 7, 2, 9, 1, 2]
    assert prop.propose(tokens) == [7, 2]
    assert NgramProposer(n_max=1, n_min=1, k=2).propose(tokens) == [9, 1]


def test_most_recent_occurrence_wins():
    tokens = [4, 1, 4, 2, 4, 3, 4]  # [4] occurred at 0, 2 and 4; the latest is followed by 3
    assert NgramProposer(n_max=2, n_min=1, k=1).propose(tokens) == [3]


def test_stops_at_the_end_of_the_sequence():
    assert NgramProposer(n_max=2, n_min=1, k=5).propose([1, 2, 3, 1, 2]) == [3, 1, 2]
    assert NgramProposer(n_max=3, n_min=1, k=4).propose([1, 1, 1, 1]) == [1]  # overlapping match


def test_no_match():
    prop = NgramProposer(n_max=3, n_min=2, k=4)
    assert prop.propose([]) == []
    assert prop.propose([1]) == []
    assert prop.propose([1, 2, 3, 4]) == []
    assert prop.propose([1, 2, 3, 2]) == [], "a 1-gram match does not count when n_min=2"
    assert NgramProposer(k=0).propose([1, 2, 1]) == []


def test_validation():
    with pytest.raises(ValueError):
        NgramProposer(n_max=1, n_min=2)
    with pytest.raises(ValueError):
        NgramProposer(n_min=0)


def _occurs_after(tokens: list[int], ngram: list[int], continuation: list[int]) -> bool:
    n, c = len(ngram), len(continuation)
    return any(tokens[j:j + n] == ngram and tokens[j + n:j + n + c] == continuation
               for j in range(len(tokens) - n))


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), max_size=30), n_max=st.integers(1, 4), n_min=st.integers(1, 4),
       k=st.integers(0, 6))
def test_proposal_is_a_continuation_that_occurred(tokens, n_max, n_min, k):
    n_min = min(n_min, n_max)
    proposal = NgramProposer(n_max=n_max, n_min=n_min, k=k).propose(tokens)
    assert len(proposal) <= k
    matching = [n for n in range(n_min, n_max + 1)
                if n < len(tokens) and _occurs_after(tokens, tokens[-n:], [])]
    if not matching or k == 0:
        assert proposal == []
        return
    n = max(matching)  # the longest suffix that occurred earlier is the one used
    assert proposal, "a suffix occurred earlier, so something must be proposed"
    assert _occurs_after(tokens, tokens[-n:], proposal), "the proposal must follow an earlier occurrence"
