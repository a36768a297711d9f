"""N-gram drafting ("prompt lookup"): propose tokens by copying from the context.

Text repeats itself: code edits echo the code in the prompt, summaries quote the
document, chat answers reuse names. If the last n tokens appeared earlier in
prompt + output, the tokens that followed them then are a good guess for what follows
now. The drafter costs no model forward and no memory, and it is deterministic: its
q is the one-hot of each proposal, so the verifier accepts a proposal x with
probability p(x) (``rejection_sample(..., draft_probs=None, ...)``).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

from minillm import seams


@dataclass(slots=True)
class NgramProposer:
    n_max: int = 3  # longest suffix to look up; longer matches are more specific
    n_min: int = 1  # shortest one we still trust
    k: int = 4  # default number of tokens to propose

    def __post_init__(self) -> None:
        if not 1 <= self.n_min <= self.n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got n_min={self.n_min}, n_max={self.n_max}")
        if self.k < 0:
            raise ValueError(f"k must be >= 0, got {self.k}")

    def propose(self, token_ids: list[int], k: int | None = None) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the suffix.

        Tries suffix lengths n = n_max down to n_min and uses the first that occurs
        earlier in ``token_ids`` (prompt + output so far); among its occurrences, the
        most recent one wins (recent context predicts best). The proposal is what
        followed that occurrence, cut at k tokens and at the end of the sequence.
        Returns [] when no suffix of length >= n_min occurred before.
        """
        k = self.k if k is None else k
        if k <= 0:
            return []
        tokens = list(token_ids)
        L = len(tokens)
        one_n = seams.plugged("ngram_propose")  # a learner's lookup for one n (chapter 5)
        if one_n is not None:
            for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
                proposal = list(one_n(tokens, n, k))
                if proposal:
                    return _checked_proposal(proposal, tokens, n, k)
            return []
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            suffix = tokens[L - n:]
            # An occurrence starting at j is followed by tokens[j + n]; j + n <= L - 1
            # also keeps the suffix from matching itself.
            for j in range(L - n - 1, -1, -1):
                if tokens[j:j + n] == suffix:
                    return tokens[j + n:j + n + k]
        return []


def _checked_proposal(proposal: list, tokens: list[int], n: int, k: int) -> list[int]:
    """A plugged lookup's proposal, checked before the engine feeds it: the scheduler reserved
    KV space for k drafts only, and prompt lookup copies what followed an earlier occurrence of
    the last n tokens (so every draft is a token of the context, in the vocabulary)."""

    def broken(invariant: str, got: str) -> seams.SeamContractError:
        return seams.SeamContractError("ngram_propose", invariant, got)

    where = f"for the last {n} tokens {tokens[-n:]} of {len(tokens)} (k={k})"
    if len(proposal) > k:
        raise broken(f"a proposal holds at most k={k} tokens", f"{where} it proposes {len(proposal)}: {proposal}")
    try:
        proposal = [operator.index(t) for t in proposal]
    except TypeError:
        raise broken("a proposal is a list of token ids (integers)", f"{where} it proposes {proposal!r:.120}") from None
    L, m = len(tokens), len(proposal)
    suffix = tokens[L - n:]
    if not any(tokens[j:j + n] == suffix and tokens[j + n:j + n + m] == proposal for j in range(L - n)):
        raise broken(f"a proposal is what followed an earlier occurrence of the last n={n} tokens",
                     f"{where} it proposes {proposal}, which follows no such occurrence")
    return proposal
