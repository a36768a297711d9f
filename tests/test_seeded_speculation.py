"""A seeded request's tokens do not depend on its batch, its token budget, the off switch -- or on speculation.

How many drafts a step verifies depends on everything else in the batch: the off switch
(``disable_by_batch_size``), the token budget left, the free blocks. So the randomness of
a request cannot be a stream consumed step by step: a verify step would shift every later
number. The engine draws the noise of the token at position p from (request seed, p)
(``sampling.position_noise``), and verification emits the target's own sample at each
position it reaches (``rejection_sampler.coupled_verify``): the output is plain
sampling's output, token for token, whatever was drafted.

Three layers:
- the pieces, on toy distributions: the noise is a function of (seed, position); the
  coupled verifier emits plain samples; for a one-hot q it IS the rejection rule
  (``verify_probs``); what the coupling costs a sampling drafter in acceptance;
- the engine on a tiny random Llama (fast): the matrix below, both drafters;
- the engine on SmolLM2 (``slow``): the reported reproduction and the matrix -- alone,
  in batches of 2/4/8 with greedy, seeded and unseeded neighbours, chunked prefill with
  budgets 8 and 64 next to a long prompt, the off switch triggering and not -- equal to
  the same request without speculation, for the n-gram and the self-draft model drafter.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from minillm import SamplingParams, loader
from minillm.config import EngineConfig, ModelConfig
from minillm.engine import build_engine
from minillm.sampling import exponential_race, noise_seed, position_noise, sample_at
from minillm.bench import exactness as ex
from minillm.spec_decode.rejection_sampler import (
    acceptance_rate,
    coupled_acceptance_rate,
    coupled_verify,
    verify_probs,
)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _random_probs(shape, generator) -> torch.Tensor:
    logits = 2 * torch.randn(shape, generator=generator, dtype=torch.float64)
    zeros = torch.rand(shape, generator=generator) < 0.25
    zeros[..., 0] = False
    return logits.masked_fill(zeros, float("-inf")).softmax(-1)


# ---------------------------------------------------------------- the noise


def test_position_noise_is_a_function_of_seed_and_position():
    V = 16
    a = position_noise(7, [0, 1, 2, 3], V)
    assert torch.equal(a[2:], position_noise(7, [2, 3], V, torch.Generator())), "rows depend on their position only"
    assert torch.equal(a[1], position_noise(7, [5, 1], V)[1]), "the order of the draws does not matter"
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], position_noise(8, [0], V)[0])
    assert (a >= 0).all() and torch.isfinite(a).all()
    # torch's CPU generator keeps 32 bits of a seed: they must differ for every position of a request
    for seed in (0, 1, 2**64 - 1, 12345 * 1_000_003):
        low = {noise_seed(seed, pos) & 0xFFFFFFFF for pos in range(20_000)}
        assert len(low) == 20_000, f"seed {seed}: two positions share their noise"
    assert not torch.equal(position_noise(1, [3], V), position_noise(1 + 2**40, [3], V)), "all 64 bits of a seed count"


def test_position_noise_samples_independently_across_seeds_and_positions():
    """Over many seeds, the tokens at positions 10 and 11 sampled from p are independent draws of p."""
    p = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    n = 6000
    pairs = [tuple(exponential_race(p, position_noise(s, [10, 11], 4).double()).tolist()) for s in range(n)]
    got = {c: v / n for c, v in Counter(pairs).items()}
    want = {(i, j): float(p[i] * p[j]) for i in range(4) for j in range(4)}
    tv, threshold = ex.total_variation(got, want), ex.tv_threshold(n, 16, two_sample=False)
    assert tv < threshold, f"position noise: TV {tv:.3f} >= {threshold:.3f} from independent draws of p"


def test_sample_at_greedy_rows_draw_nothing_and_rows_do_not_see_each_other():
    logits = torch.randn(4, 10, generator=_gen(0))
    params = [SamplingParams(temperature=0.8, seed=3), SamplingParams(temperature=0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.5, top_k=3)]
    out = sample_at(logits, params, [3, None, 11, 12], [5, 9, 7, 2])
    assert int(out[1]) == int(logits[1].argmax())
    alone = sample_at(logits[[0, 3]], [params[0], params[3]], [3, 12], [5, 2])
    assert out[[0, 3]].tolist() == alone.tolist()


# ---------------------------------------------------------------- the coupled verifier


def _with_drafts_like(y: torch.Tensor, k: int, generator, V: int) -> torch.Tensor:
    """Drafts that agree with y for a random number of leading slots, then random."""
    B = y.shape[0]
    d = torch.randint(0, V, (B, k), generator=generator)
    agree = torch.randint(0, k + 1, (B,), generator=generator)
    d = torch.where(torch.arange(k)[None, :] < agree[:, None], y[:, :k], d)
    d[::5, k // 2:] = -1  # some rows with fewer drafts
    return d


@pytest.mark.parametrize("k", [1, 3, 5])
def test_coupled_verify_emits_exactly_the_plain_samples(k):
    """Whatever was drafted, the emitted tokens are argmax(p_i / E_i), the tokens plain sampling draws."""
    B, V = 200, 7
    g = _gen(k)
    p = _random_probs((B, k + 1, V), g)
    p[:20] = torch.nn.functional.one_hot(p[:20].argmax(-1), V).double()  # greedy rows
    noise = torch.empty(B, k + 1, V, dtype=torch.float64).exponential_(generator=g)
    y = exponential_race(p, noise)  # [B, k+1]
    d = _with_drafts_like(y, k, g, V)
    out, num = coupled_verify(d, p, noise)
    for b in range(B):
        n = int(num[b])
        assert out[b, :n].tolist() == y[b, :n].tolist(), "every emitted token is the target's own sample"
        assert out[b, n:].tolist() == [-1] * (k + 1 - n)
        lead = 0
        while lead < k and int(d[b, lead]) == int(y[b, lead]):
            lead += 1
        assert n == lead + 1, "accept exactly the leading drafts that agree, then one more token"
    assert (num > 1).any() and (num < k + 1).any()


def test_coupled_verify_is_the_rejection_rule_for_one_hot_drafts():
    """A deterministic drafter (q one-hot on x): P(accept x_i) = p_i(x_i) and the token emitted
    where the walk stops follows ``verify_probs``'s emit_probs (the residual, or the bonus p_k).

    Exact for the acceptance (``coupled_acceptance_rate`` of a one-hot q), within sampling
    noise for the whole walk: N noise draws, the frequency of stopping at each slot against
    a_0 ... a_{i-1} (1 - a_i), and the emitted token given the stop against emit_probs[i].
    """
    V, k, N = 6, 2, 30_000
    p = _random_probs((1, k + 1, V), _gen(1))
    d = torch.tensor([[int(p[0, 0].argmax()), int(p[0, 1].argsort()[-2])]])  # a likely draft, a less likely one
    accept, emit = verify_probs(d, None, p)  # the rule: [1, k], [1, k+1, V]
    one_hot = torch.nn.functional.one_hot(d[0], V).double()
    assert torch.allclose(coupled_acceptance_rate(p[0, :k], one_hot), accept[0], atol=1e-12)

    noise = torch.empty(N, k + 1, V, dtype=torch.float64).exponential_(generator=_gen(2))
    out, num = coupled_verify(d.expand(N, k), p.expand(N, k + 1, V), noise)
    a = accept[0].tolist()
    reach = [1.0, a[0], a[0] * a[1]]
    stop = [reach[0] * (1 - a[0]), reach[1] * (1 - a[1]), reach[2]]
    for i in range(k + 1):
        at_i = num == i + 1
        freq = float(at_i.double().mean())
        sigma = (stop[i] * (1 - stop[i]) / N) ** 0.5
        assert abs(freq - stop[i]) < 5 * sigma + 1e-9, f"the walk stops at slot {i} with frequency {freq:.4f}, " \
                                                       f"the rule says {stop[i]:.4f}"
        tokens = out[at_i, i]
        got = {(t,): c / len(tokens) for t, c in Counter(tokens.tolist()).items()}
        want = {(t,): float(emit[0, i, t]) for t in range(V)}
        tv, threshold = ex.total_variation(got, want), ex.tv_threshold(len(tokens), V, two_sample=False)
        assert tv < threshold, f"slot {i}: the emitted token is off the rule's emit_probs by TV {tv:.3f}"


def test_the_coupling_costs_a_sampling_drafter_some_acceptance():
    """With a sampling drafter the coupled acceptance P(argmax q/E = argmax p/E) lies between
    (1 - TV) / (1 + TV) and the rule's 1 - TV = sum min(p, q); measured on a toy drafter that
    roughly agrees with its target, and checked against simulation."""
    V = 8
    t_logits = ex.toy_logits_model(V, 5, scale=1.5)
    d_logits = ex.toy_logits_model(V, 1005, scale=1.5, base=t_logits)
    params = SamplingParams(temperature=1.0)
    target, draft = ex.toy_probs_model(t_logits, params), ex.toy_probs_model(d_logits, params)
    prefixes = [(), (1,), (2, 3), (4, 4, 0), (7,)]
    p = torch.stack([target(pr) for pr in prefixes])
    q = torch.stack([draft(pr) for pr in prefixes])
    rule, coupled = acceptance_rate(p, q), coupled_acceptance_rate(p, q)
    tv = 1 - rule
    assert ((1 - tv) / (1 + tv) <= coupled + 1e-12).all() and (coupled <= rule + 1e-12).all()
    noise = torch.empty(40_000, len(prefixes), V, dtype=torch.float64).exponential_(generator=_gen(3))
    simulated = (exponential_race(p, noise) == exponential_race(q, noise)).double().mean(0)
    assert torch.allclose(simulated, coupled, atol=0.01), "the closed form must match simulation"
    print(f"\nacceptance per slot, rule sum min(p, q): {[round(x, 3) for x in rule.tolist()]}; "
          f"coupled: {[round(x, 3) for x in coupled.tolist()]}; mean {float(rule.mean()):.3f} -> "
          f"{float(coupled.mean()):.3f}")
    assert float(rule.mean() - coupled.mean()) < 0.1, "on a drafter this close the cost is small"
    # and random pairs of distributions: the bounds always hold
    g = _gen(4)
    p, q = _random_probs((500, V), g), _random_probs((500, V), g)
    rule, coupled = acceptance_rate(p, q), coupled_acceptance_rate(p, q)
    tv = 1 - rule
    assert ((1 - tv) / (1 + tv) <= coupled + 1e-12).all() and (coupled <= rule + 1e-12).all()


def test_coupled_speculation_on_a_toy_model_is_plain_sampling():
    """Speculative decoding with a sampling drafter, as the engine runs it, on toy models: every
    seed gives exactly plain sampling's tokens, so the distribution is the target's; a verifier
    that always accepts the drafts gives neither."""
    V, n, m = 4, 3000, 2
    t_logits = ex.toy_logits_model(V, 23, scale=1.5)
    d_logits = ex.toy_logits_model(V, 1023, scale=1.5, base=t_logits)
    target = ex.toy_probs_model(t_logits, SamplingParams(temperature=1.0))
    draft = ex.toy_probs_model(d_logits, SamplingParams(temperature=1.0, top_k=2))
    plain = ex.sample_plain_at(target, n, m, seed=100)
    spec = ex.sample_speculative_coupled(target, draft, 2, n, m, seed=100)
    assert torch.equal(spec, plain), "speculative output must be plain sampling's, seed by seed"
    exact = ex.target_distribution(target, m)
    got = {c: v / n for c, v in Counter(map(tuple, spec.tolist())).items()}
    threshold = ex.tv_threshold(n, V ** m, two_sample=False)
    assert ex.total_variation(got, exact) < threshold

    def always_accept(d, p, noise):
        y = exponential_race(p, noise)
        return torch.cat([d, y[:, -1:]], dim=1), torch.full((d.shape[0],), d.shape[1] + 1)

    wrong = ex.sample_speculative_coupled(target, draft, 2, n, m, seed=100, verifier=always_accept)
    bad = {c: v / n for c, v in Counter(map(tuple, wrong.tolist())).items()}
    assert ex.total_variation(bad, exact) > threshold, "the always-accept verifier must fail the same test"


def test_coupled_verify_rejects_bad_shapes():
    d, p = torch.zeros(2, 2, dtype=torch.long), torch.full((2, 3, 4), 0.25)
    with pytest.raises(ValueError, match="noise"):
        coupled_verify(d, p, torch.ones(2, 2, 4))
    with pytest.raises(ValueError, match="target_probs"):
        coupled_verify(d, p[:, :2], torch.ones(2, 2, 4))



def test_coupled_verify_stops_at_any_padding_without_reading_the_device():
    """A -1 never matches, wherever it sits: the walk stops there and emits the target's own
    token, so the output is still plain sampling's. (Checking that -1 only pads the end
    would cost a device read per verification.)"""
    p = torch.tensor([[0.1, 0.2, 0.6, 0.1]]).repeat(3, 1)[None].repeat(2, 1, 1)  # [2, 3, 4], argmax 2
    out, num = coupled_verify(torch.tensor([[-1, 2], [2, -1]]), p, torch.ones(2, 3, 4))
    assert num.tolist() == [1, 2]
    assert out.tolist() == [[2, -1, -1], [2, 2, -1]]


# ---------------------------------------------------------------- the engine, tiny model (fast)

TINY = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                   head_dim=8, max_position_embeddings=256, eos_token_id=2)
TINY_WEIGHTS = {k: v if "norm" in k else v * 10.0 for k, v in loader.dummy_weights(TINY, 0).items()}
TINY_SPECS = {"ngram": dict(method="ngram", prompt_lookup_min=1), "model": dict(method="model", draft_layers=[0, 2])}


@pytest.fixture
def one_thread():
    """The tiny model runs fastest on one thread (no OpenMP workers to wait for on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_engine(spec=None, **kwargs):
    opts = dict(engine="paged", device="cpu", dtype="float32", max_model_len=128, block_size=4, max_num_seqs=8)
    return build_engine(EngineConfig(**(opts | kwargs), speculative=spec), weights=TINY_WEIGHTS, tokenizer=None,
                        model_config=TINY)


def _tiny_prompt(n, seed):
    g = _gen(seed)
    motif = torch.randint(3, TINY.vocab_size, (4,), generator=g).tolist()
    return (motif * (n // 4 + 1))[:n]


TINY_TARGET = _tiny_prompt(12, 0)
TINY_SEEDED = SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True)
TINY_OTHERS = [(_tiny_prompt(9 + i, i + 1), sp) for i, sp in enumerate([
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=6, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True),  # unseeded
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.7, top_k=5, max_tokens=8, ignore_eos=True),
    SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True),
    SamplingParams(temperature=0.9, seed=5, max_tokens=14, ignore_eos=True),  # the same seed, another prompt
])]


def target_tokens(engine, prompt, params, others, first=False):
    """The seeded request's tokens when it runs with ``others`` (it goes in the middle of the batch)."""
    half = len(others) // 2
    reqs = [engine.make_request(p, sp) for p, sp in others[:half]]
    mine = engine.make_request(prompt, params)
    reqs.insert(0 if first else half, mine)
    reqs += [engine.make_request(p, sp) for p, sp in others[half:]]
    outs = engine.run(reqs)
    return outs[reqs.index(mine)].token_ids


def matrix(others, long_prompt, full=True):
    """(name, engine options, speculative options, neighbours): the batch, the budget and the off switch vary.

    The off switch (at 2 for a batch of 2, at 4 for larger ones) stops speculation while the
    batch is full and lets it back in once the shorter neighbours have finished: both within
    one run. ``full=False``: batches of 2 and 8 with the switch, of 4 without it.
    """
    rows = [("alone", {}, dict(disable_by_batch_size=None), [])]
    cases = [(2, 2), (4, None), (8, 4)] + ([(2, None), (4, 4), (8, None)] if full else [])
    for b, switch in cases:
        name = f"batch {b}" + (", off switch" if switch else "")
        rows.append((name, {}, dict(disable_by_batch_size=switch), others[:b - 1]))
    long_other = [(long_prompt, SamplingParams(temperature=0.8, max_tokens=8, ignore_eos=True))]
    for budget in (8, 64):
        opts = dict(enable_chunked_prefill=True, max_num_batched_tokens=budget, max_num_seqs=4)
        rows.append((f"chunked prefill, budget {budget}", opts, dict(disable_by_batch_size=None),
                     long_other + others[:2]))
    return rows


@pytest.mark.parametrize("drafter", sorted(TINY_SPECS))
def test_tiny_seeded_output_is_independent_of_batch_budget_and_speculation(drafter, one_thread):
    ref = target_tokens(tiny_engine(), TINY_TARGET, TINY_SEEDED, [])
    assert len(set(ref)) > 3, "the test needs a request that really samples"
    for name, opts, spec, others in matrix(TINY_OTHERS, _tiny_prompt(90, 9)):
        engine = tiny_engine(TINY_SPECS[drafter] | dict(num_speculative_tokens=3) | spec, **opts)
        got = target_tokens(engine, TINY_TARGET, TINY_SEEDED, others)
        assert got == ref, f"{drafter}, {name}: the seeded request's tokens changed"
        st = engine.spec_stats
        assert st.num_drafts > 0, f"{drafter}, {name}: the run must speculate somewhere"
        if spec["disable_by_batch_size"] is not None:
            assert st.verify_rows < st.decode_rows, f"{name}: the off switch must have triggered"
    plain_batched = target_tokens(tiny_engine(), TINY_TARGET, TINY_SEEDED, TINY_OTHERS)
    assert plain_batched == ref, "without speculation too, the batch changes nothing"


# ---------------------------------------------------------------- the engine, SmolLM2 (slow)

LINE = "the quick brown fox jumps over the lazy dog"
REPEAT = f"Repeat the line.\nLine: {LINE}\nLine: {LINE}\nLine: {LINE}\nLine:"
SEEDED = SamplingParams(temperature=0.8, seed=1, max_tokens=24, ignore_eos=True)
REAL_SPECS = {"ngram": dict(method="ngram"), "model": dict(method="model", draft_layers=list(range(8)))}


@pytest.fixture(scope="module")
def real_one_thread():
    """One thread: on a small busy CPU, OpenMP workers waiting for each other cost more than they add."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def real(real_one_thread):
    """(weights, tokenizer, the seeded request's tokens without speculation): loaded once for the module."""
    weights, tok = loader.load_weights(None), loader.load_tokenizer(None)
    ref = target_tokens(real_engine(weights, tok, None), REPEAT, SEEDED, [])
    return weights, tok, ref


def real_engine(weights, tok, spec, **kwargs):
    opts = dict(engine="paged", device="cpu", dtype="float32", max_model_len=256, max_num_seqs=8) | kwargs
    return build_engine(EngineConfig(**opts, speculative=spec), weights=weights, tokenizer=tok)


def real_others(tok):
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "List three colors:",
               "Water boils at", "1, 2, 3, 4,", "The best way to learn is"]
    params = [SamplingParams(temperature=0, max_tokens=12),
              SamplingParams(temperature=0.8, seed=2, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True),  # unseeded
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0.7, top_p=0.9, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=1, max_tokens=24, ignore_eos=True),  # the same seed
              SamplingParams(temperature=1.0, top_k=20, max_tokens=6, ignore_eos=True)]
    return [(tok(p).input_ids, sp) for p, sp in zip(prompts, params)]


@pytest.mark.slow
def test_real_reported_reproduction(real):
    """The report: alone the request speculates, next to a greedy one the off switch stops it."""
    weights, tok, ref = real
    engine = real_engine(weights, tok, dict(method="ngram", disable_by_batch_size=2), max_model_len=128,
                         max_num_seqs=2)
    alone = target_tokens(engine, REPEAT, SEEDED, [], first=True)
    assert engine.spec_stats.num_accepted > 0
    batched = target_tokens(engine, REPEAT, SEEDED, [(tok("The capital of France is").input_ids,
                                                      SamplingParams(temperature=0, max_tokens=24))], first=True)
    assert alone == batched == ref


@pytest.mark.slow
@pytest.mark.parametrize("drafter", sorted(REAL_SPECS))
def test_real_seeded_output_is_independent_of_batch_budget_and_speculation(real, drafter):
    weights, tok, ref = real
    others = real_others(tok)
    long_prompt = tok(" ".join(f"Item {i}: a note about {w}." for i, w in enumerate(
        ["apples", "rivers", "engines", "music", "glass", "paper", "stone", "light", "salt", "wind"]))).input_ids
    assert len(long_prompt) >= 80
    for name, opts, spec, neighbours in matrix(others, long_prompt, full=False):
        engine = real_engine(weights, tok, REAL_SPECS[drafter] | spec, **opts)
        got = target_tokens(engine, REPEAT, SEEDED, neighbours)
        assert got == ref, f"{drafter}, {name}: the seeded request's tokens changed"
        st = engine.spec_stats
        assert st.num_drafts > 0, f"{drafter}, {name}: the run must speculate somewhere"
        if spec["disable_by_batch_size"] is not None:
            assert st.verify_rows < st.decode_rows, f"{name}: the off switch must have triggered"
        if drafter == "ngram" and name == "alone":
            assert st.num_accepted > 0, "the repeated line must get drafts accepted"
