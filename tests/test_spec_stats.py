"""The acceptance estimate: alpha measured the way the formula E = (1 - a^(k+1)) / (1 - a) needs.

Verification stops at the first rejected draft; drafts after it are never judged. With
independent acceptances of probability alpha, accepted / drafted is biased low (0.59 for
alpha = 0.8, k = 4); accepted / drafts-reached is not.
"""
import random

import pytest

from minillm.config import SpeculativeConfig
from minillm.request import Request
from minillm.sampling_params import SamplingParams
from minillm.scheduler.output import ScheduledRequest, SchedulerOutput
from minillm.spec_decode.drafters import NgramDrafter
from minillm.spec_decode.rejection_sampler import expected_num_emitted
from minillm.spec_decode.speculator import Speculator


def simulated_stats(alpha: float, k: int, steps: int, seed: int = 0):
    """Feed the speculator's counters with verifications whose drafts are accepted
    independently with probability alpha (the walk stops at the first rejection)."""
    rng = random.Random(seed)
    spec = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=k), NgramDrafter())
    r = Request("r", [1, 2, 3], SamplingParams())
    for _ in range(steps):
        row = ScheduledRequest(r, 1, max_drafts=k, spec_token_ids=[5] * k)
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        spec._count(SchedulerOutput([row]), {0: [5] * (accepted + 1)})
    return spec.stats


@pytest.mark.parametrize("alpha", [0.3, 0.8, 0.95])
def test_acceptance_rate_is_unbiased_for_independent_drafts(alpha):
    st = simulated_stats(alpha, k=4, steps=20_000)
    # binomial noise over ~20k-80k judged drafts: well under 0.01
    assert st.acceptance_rate == pytest.approx(alpha, abs=0.01)
    # and the formula then predicts the measured tokens per forward
    assert expected_num_emitted(st.acceptance_rate, 4) == pytest.approx(st.tokens_per_target_forward, rel=0.02)


def test_accepted_over_drafted_is_biased_low():
    st = simulated_stats(0.8, k=4, steps=20_000)
    # E[accepted] / k = (0.8 + 0.64 + 0.512 + 0.4096) / 4 = 0.59
    assert st.draft_acceptance_ratio == pytest.approx(0.5904, abs=0.01)
    assert expected_num_emitted(st.draft_acceptance_ratio, 4) < 0.75 * st.tokens_per_target_forward
    assert st.as_dict()["acceptance_rate"] == st.acceptance_rate


def test_every_draft_accepted_or_none():
    st = simulated_stats(1.0, k=3, steps=10)
    assert st.acceptance_rate == 1.0 and st.num_checked == 30
    st = simulated_stats(0.0, k=3, steps=10)
    assert st.acceptance_rate == 0.0 and st.num_checked == 10 and st.draft_acceptance_ratio == 0.0
