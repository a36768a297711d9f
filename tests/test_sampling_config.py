"""SamplingParams / EngineConfig validation and the sampler, without the model."""
import dataclasses

import pytest
import torch

from minillm import EngineConfig, SamplingParams
from minillm.config import SpeculativeConfig
from minillm.sampling import apply_top_k, apply_top_k_top_p, compute_probs, sample, sample_from_probs


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"seed": "x"}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_unknown_sampling_param_is_rejected():
    with pytest.raises(TypeError):
        SamplingParams(temprature=0.5)


def test_unknown_engine_and_options_list_valid_ones():
    with pytest.raises(ValueError, match="valid engines: simple"):
        EngineConfig.from_kwargs(engine="turbo")
    with pytest.raises(ValueError, match="valid options:.*max_model_len"):
        EngineConfig.from_kwargs(max_model_lenn=5)
    for bad in ({"max_num_seqs": 0}, {"block_size": 12}, {"max_model_len": -1}, {"dtype": "int8"},
                {"attention_backend": "cuda"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EngineConfig.from_kwargs(**bad)


def test_top_k_keeps_exactly_k_and_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    kept = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([1.0]))
    assert torch.isfinite(kept).sum() == 2 and torch.isfinite(kept[0, :2]).all()
    # 0.5 + 0.2 = 0.7 < 0.75, so the nucleus needs the third token too.
    kept = apply_top_k_top_p(logits, torch.tensor([-1]), torch.tensor([0.75]))
    assert torch.isfinite(kept).sum() == 3
    kept = apply_top_k_top_p(logits, torch.tensor([-1]), torch.tensor([0.01]))
    assert torch.isfinite(kept).sum() == 1  # the most likely token always stays


@pytest.mark.parametrize("ks", [[2, 2, 2], [1, 5, -1, 40], [-1, 3], [60, 64, 200]])
def test_top_k_alone_is_the_sorted_rule_without_the_sort(ks):
    """compute_probs takes ``apply_top_k`` (topk of the largest k) when no row uses top-p:
    the same logits kept, the same values, bit for bit, as the sort-based rule."""
    g = torch.Generator().manual_seed(len(ks))
    logits = torch.randn(len(ks), 64, generator=g) * 3  # distinct values: no ties at the k-th
    top_k = torch.tensor(ks)
    fast = apply_top_k(logits, top_k, max(ks))
    assert torch.equal(fast, apply_top_k_top_p(logits, top_k, torch.ones(len(ks))))
    params = [SamplingParams(temperature=0.7, top_k=k) for k in ks]
    probs = compute_probs(logits, params)
    assert torch.equal(probs, (apply_top_k_top_p(logits / torch.tensor(0.7), top_k, torch.ones(len(ks)))).softmax(-1))
    assert [int((row > 0).sum()) for row in probs] == [64 if k < 0 else min(k, 64) for k in ks]


def test_compute_probs_temperature_and_greedy():
    logits = torch.tensor([[2.0, 1.0, 0.0], [2.0, 1.0, 0.0]])
    p = compute_probs(logits, [SamplingParams(temperature=0.5), SamplingParams(temperature=0)])
    torch.testing.assert_close(p[0], (logits[0] / 0.5).softmax(-1))
    assert p[1].tolist() == [1.0, 0.0, 0.0]


def test_sampler_draws_the_right_distribution():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    g = torch.Generator().manual_seed(0)
    n = 20000
    draws = torch.stack([sample_from_probs(probs[None], [g]) for _ in range(n)]).flatten()
    freq = torch.bincount(draws, minlength=4).float() / n
    # Each frequency is within 4 standard errors of its probability.
    se = (probs * (1 - probs) / n).sqrt()
    assert ((freq - probs).abs() < 4 * se).all(), freq


def test_seeded_sampling_ignores_the_rest_of_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=7)] + [SamplingParams(temperature=0.8)] * 3
    alone = sample(logits[:1], params[:1], [torch.Generator().manual_seed(7)])
    gens = [torch.Generator().manual_seed(s) for s in (7, 1, 2, 3)]
    batched = sample(logits, params, gens)
    assert batched[0] == alone[0]


def test_greedy_rows_draw_no_random_numbers():
    g = torch.Generator().manual_seed(3)
    state = g.get_state().clone()
    sample(torch.randn(2, 10), [SamplingParams(temperature=0)] * 2, [g, g])
    assert torch.equal(g.get_state(), state)


# -- inputs that were accepted and then did the wrong thing --------------------------------

@pytest.mark.parametrize("cls, kwargs, field", [
    (SamplingParams, {"ignore_eos": "false"}, "ignore_eos"),
    (SamplingParams, {"ignore_eos": 1}, "ignore_eos"),
    (SamplingParams, {"include_stop_str_in_output": "no"}, "include_stop_str_in_output"),
    (EngineConfig, {"dummy_weights": "no"}, "dummy_weights"),
    (EngineConfig, {"dummy_weights": None}, "dummy_weights"),
    (EngineConfig, {"engine": "paged", "enable_chunked_prefill": "yes"}, "enable_chunked_prefill"),
    (SpeculativeConfig, {"method": "ngram", "adaptive": "yes"}, "adaptive"),
])
def test_bool_options_must_be_bools(cls, kwargs, field):
    # bool("no") is True: a string used to switch the option on without a word.
    with pytest.raises(ValueError, match=f"{field} must be True or False"):
        cls(**kwargs)


def test_every_bool_field_is_checked():
    for cls, base in ((SamplingParams, {}), (EngineConfig, {"engine": "paged"}),
                      (SpeculativeConfig, {"method": "ngram"})):
        bools = [f.name for f in dataclasses.fields(cls) if f.type in ("bool", bool)]
        assert bools, cls
        for name in bools:
            with pytest.raises(ValueError, match=name):
                cls(**base, **{name: "false"})


@pytest.mark.parametrize("kwargs, field", [
    ({"stop": 5}, "stop must be a string or a list"),
    ({"stop": [5]}, "stop must be"),
    ({"stop": b"x"}, "stop must be"),
    ({"stop_token_ids": 5}, "stop_token_ids must be a list"),
    ({"stop_token_ids": "2"}, "stop_token_ids must be a list"),
    ({"stop_token_ids": [2.0]}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"seed": 2**64}, r"seed must be an integer in \[0, 2\*\*64\)"),
    ({"seed": -1}, r"seed must be an integer in \[0, 2\*\*64\)"),
    ({"seed": 1.5}, "seed"),
    ({"seed": True}, "seed"),
])
def test_stop_rules_and_seed_are_checked_at_construction(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_accepts_what_vllm_accepts():
    p = SamplingParams(stop=None, stop_token_ids=None)
    assert p.stop == [] and p.stop_token_ids == []
    p = SamplingParams(stop="###", stop_token_ids=(2, 3), seed=2**64 - 1, include_stop_str_in_output=True)
    assert p.stop == ["###"] and p.stop_token_ids == [2, 3] and p.include_stop_str_in_output is True
    assert SamplingParams().include_stop_str_in_output is False
    # Every accepted seed is one torch takes.
    for seed in (0, 2**63, 2**64 - 1):
        torch.Generator().manual_seed(SamplingParams(seed=seed).seed)


@pytest.mark.parametrize("seed", ["x", 1.5, -1, 2**32, True])
def test_engine_seed_is_an_integer_in_range(seed):
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*32\)"):
        EngineConfig(seed=seed)


def test_engine_seed_range_keeps_derived_request_seeds_valid():
    # The engine seeds request i without its own seed with config.seed * 1_000_003 + i.
    cfg = EngineConfig(seed=2**32 - 1)
    torch.Generator().manual_seed(cfg.seed * 1_000_003 + 2**40)


def test_device_must_be_a_string():
    with pytest.raises(ValueError, match="device must be"):
        EngineConfig(device=0)
