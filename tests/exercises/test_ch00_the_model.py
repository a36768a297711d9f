"""Grades exercises/ch00_the_model.py (or solutions/, with MINILLM_IMPL=solutions).

Every check compares against an oracle written here or taken from transformers, never
against minillm, so the tests stay meaningful for the solutions that wrap minillm.
Small tensors and seeded generators only: the whole file runs in seconds.
"""
from __future__ import annotations

import math

import pytest
import torch

import adapters
from minillm.course import quiz

pytestmark = pytest.mark.exercises

CHAPTER = "ch00_the_model"
rms_norm = adapters.function(CHAPTER, "rms_norm")
rope_cos_sin = adapters.function(CHAPTER, "rope_cos_sin")
apply_rope = adapters.function(CHAPTER, "apply_rope")
apply_top_k_top_p = adapters.function(CHAPTER, "apply_top_k_top_p")
sample_next_token = adapters.function(CHAPTER, "sample_next_token")
decode_bytes_per_token = adapters.function(CHAPTER, "decode_bytes_per_token")
greedy_generate = adapters.function(CHAPTER, "greedy_generate")
quiz_answers = adapters.function(CHAPTER, "quiz_answers")


def _llama():
    """transformers' Llama module, the independent oracle for RMSNorm and RoPE."""
    return pytest.importorskip("transformers.models.llama.modeling_llama")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- rms_norm


def _rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The textbook formula in float64."""
    xd = x.double()
    return xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def test_rms_norm_formula():
    x = torch.randn(2, 3, 64, generator=_gen(0))  # [..., D] with two leading dims
    w = 1 + 0.1 * torch.randn(64, generator=_gen(1))
    out = rms_norm(x, w, 1e-5)
    assert isinstance(out, torch.Tensor) and out.shape == x.shape, (
        f"rms_norm must return a tensor shaped like x {tuple(x.shape)}, got "
        f"{getattr(out, 'shape', type(out).__name__)}"
    )
    assert out.dtype == torch.float32, f"float32 in, float32 out; got {out.dtype}"
    torch.testing.assert_close(
        out.double(), _rms_norm_ref(x, w, 1e-5), atol=1e-5, rtol=1e-5,
        msg=lambda m: "rms_norm must be x / sqrt(mean(x**2, last dim) + eps) * weight\n" + m,
    )


def test_rms_norm_eps_and_scale_invariance():
    x = torch.randn(4, 32, generator=_gen(2))
    ones = torch.ones(32)
    torch.testing.assert_close(
        rms_norm(3.0 * x, ones, 0.0), rms_norm(x, ones, 0.0),
        msg=lambda m: "with eps=0, rms_norm(c * x) must equal rms_norm(x): RMSNorm only rescales\n" + m,
    )
    tiny = torch.full((1, 32), 1e-3)  # rms 1e-3: eps = 1e-6 = rms**2 matters here
    expected = 1e-3 / math.sqrt(1e-6 + 1e-6)
    torch.testing.assert_close(
        rms_norm(tiny, ones, 1e-6), torch.full((1, 32), expected),
        msg=lambda m: "eps goes inside the square root: x / sqrt(mean(x**2) + eps)\n" + m,
    )


def test_rms_norm_matches_transformers():
    llama = _llama()
    for dtype, tol in [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)]:
        hf = llama.LlamaRMSNorm(48, eps=1e-6)
        with torch.no_grad():
            hf.weight.copy_(1 + 0.1 * torch.randn(48, generator=_gen(3)))
        hf = hf.to(dtype)
        x = torch.randn(5, 48, generator=_gen(4)).to(dtype)
        out = rms_norm(x, hf.weight.detach(), 1e-6)
        assert out.dtype == dtype, f"rms_norm must return x.dtype ({dtype}) when weight has x.dtype, got {out.dtype}"
        with torch.no_grad():
            expected = hf(x)
        torch.testing.assert_close(
            out, expected, atol=tol, rtol=tol,
            msg=lambda m: f"rms_norm must match transformers' LlamaRMSNorm in {dtype}\n" + m,
        )


def test_rms_norm_statistics_in_float32():
    # |x| ~ 1000: x**2 ~ 1e6 overflows float16 (max 65504) unless squared in float32.
    x = (1000 * torch.randn(3, 64, generator=_gen(5))).half()
    w = torch.ones(64, dtype=torch.float16)
    out = rms_norm(x, w, 1e-5)
    assert out.dtype == torch.float16, f"float16 in, float16 out; got {out.dtype}"
    assert torch.isfinite(out).all() and out.abs().max() > 0.1, (
        "rms_norm must compute mean(x**2) in float32: in float16 the squares of values above ~256 "
        "overflow to inf and the output collapses to 0"
    )
    torch.testing.assert_close(
        out.double(), _rms_norm_ref(x, w, 1e-5), atol=1e-2, rtol=1e-2,
        msg=lambda m: "rms_norm in float16 must match the float64 formula to float16 precision\n" + m,
    )


# ---------------------------------------------------------------- RoPE


def _rope_ref(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, head_dim] in float64, "rotate half" layout."""
    i = torch.arange(head_dim // 2, dtype=torch.float64)
    inv_freq = theta ** (-2 * i / head_dim)  # [D/2]
    angle = positions.double()[:, None] * inv_freq[None, :]  # [T, D/2]
    angle = torch.cat([angle, angle], dim=-1)  # [T, D]
    return angle.cos(), angle.sin()


def _apply_rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotation written pair by pair, in float64."""
    half = x.shape[-1] // 2
    x = x.double()
    a, b = x[..., :half], x[..., half:]  # pair i is (a[i], b[i])
    c, s = cos[:, None, :half].double(), sin[:, None, :half].double()
    return torch.cat([a * c - b * s, b * c + a * s], dim=-1)


# A flat batch: three sequences, positions restart at 0 for each one.
_POSITIONS = torch.tensor([0, 1, 2, 3, 0, 1, 0, 7, 100, 2047])


def test_rope_cos_sin_values():
    cos, sin = rope_cos_sin(_POSITIONS, 64, 100000.0)
    T = len(_POSITIONS)
    for name, t in (("cos", cos), ("sin", sin)):
        assert isinstance(t, torch.Tensor) and t.shape == (T, 64), (
            f"rope_cos_sin must return {name} shaped [T, head_dim] = [{T}, 64], "
            f"got {getattr(t, 'shape', type(t).__name__)}"
        )
        assert t.dtype == torch.float32, f"{name} must be float32, got {t.dtype}"
    ref_cos, ref_sin = _rope_ref(_POSITIONS, 64, 100000.0)
    contract = "angle[t, i] = positions[t] / theta ** (2i / head_dim), repeated twice along the last dim\n"
    torch.testing.assert_close(cos.double(), ref_cos, atol=1e-3, rtol=0, msg=lambda m: "cos: " + contract + m)
    torch.testing.assert_close(sin.double(), ref_sin, atol=1e-3, rtol=0, msg=lambda m: "sin: " + contract + m)


def test_rope_cos_sin_layout():
    cos, sin = rope_cos_sin(torch.arange(6), 8, 10000.0)
    assert torch.equal(cos[:, :4], cos[:, 4:]) and torch.equal(sin[:, :4], sin[:, 4:]), (
        "rotate-half layout: columns i and i + head_dim/2 must hold the same angle (cat([freqs, freqs]))"
    )
    torch.testing.assert_close(
        cos[0], torch.ones(8), msg=lambda m: "position 0 has angle 0 for every pair: cos = 1\n" + m
    )
    torch.testing.assert_close(
        sin[0], torch.zeros(8), msg=lambda m: "position 0 has angle 0 for every pair: sin = 0\n" + m
    )
    torch.testing.assert_close(
        sin[:, 0], torch.arange(6).float().sin(),
        msg=lambda m: "pair 0 turns at frequency theta**0 = 1 radian per position\n" + m,
    )


def test_apply_rope_formula():
    T, H, D = len(_POSITIONS), 3, 16
    x = torch.randn(T, H, D, generator=_gen(6))
    cos, sin = (t.float() for t in _rope_ref(_POSITIONS, D, 10000.0))
    out = apply_rope(x, cos, sin)
    assert isinstance(out, torch.Tensor) and out.shape == (T, H, D), (
        f"apply_rope must return [T, H, D] = {(T, H, D)}, got {getattr(out, 'shape', type(out).__name__)}"
    )
    torch.testing.assert_close(
        out.double(), _apply_rope_ref(x, cos, sin), atol=1e-5, rtol=1e-5,
        msg=lambda m: "apply_rope rotates each pair (x[i], x[i + D/2]) by its angle, the same for every head; "
                      "pairs are halves, not neighbours (2i, 2i + 1)\n" + m,
    )


def test_apply_rope_matches_transformers():
    llama = _llama()
    T, H, D = 7, 2, 32
    cos, sin = (t.float() for t in _rope_ref(torch.arange(T) * 3, D, 100000.0))
    for dtype, tol in [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)]:
        q = torch.randn(T, H, D, generator=_gen(7)).to(dtype)
        k = torch.randn(T, 1, D, generator=_gen(8)).to(dtype)  # GQA: fewer key heads than query heads
        c, s = cos.to(dtype), sin.to(dtype)
        # transformers rotates [..., heads, T, D]-shaped q and k; with unsqueeze_dim=1 it
        # broadcasts cos [T, D] -> [T, 1, D], which is exactly our [T, H, D] layout.
        ref_q, ref_k = llama.apply_rotary_pos_emb(q, k, c, s, unsqueeze_dim=1)
        for name, x, ref in (("queries", q, ref_q), ("keys", k, ref_k)):
            out = apply_rope(x, c, s)
            assert out.dtype == dtype, f"apply_rope must return x.dtype ({dtype}), got {out.dtype}"
            torch.testing.assert_close(
                out, ref, atol=tol, rtol=tol,
                msg=lambda m: f"apply_rope on {name} in {dtype} must match transformers' apply_rotary_pos_emb\n" + m,
            )


def test_apply_rope_encodes_relative_positions():
    D = 32
    q, k = torch.randn(2, 1, 1, D, generator=_gen(9))  # one query and one key, [1, 1, D] each
    positions = torch.tensor([0, 5, 9, 12, 16, 40])
    cos, sin = (t.float() for t in _rope_ref(positions, D, 10000.0))

    def score(m: int, n: int) -> float:  # query at positions[m], key at positions[n]
        rq = apply_rope(q, cos[m:m + 1], sin[m:m + 1])
        rk = apply_rope(k, cos[n:n + 1], sin[n:n + 1])
        return float((rq * rk).sum())

    torch.testing.assert_close(
        apply_rope(q, cos[:1], sin[:1]), q, msg=lambda m: "position 0 must leave x unchanged\n" + m
    )
    rotated = apply_rope(q.expand(6, 1, D).contiguous(), cos, sin)
    torch.testing.assert_close(
        rotated.norm(dim=-1), q.norm(dim=-1).expand(6, 1),
        msg=lambda m: "a rotation preserves the norm of every head vector\n" + m,
    )
    # distance 4 twice (9 - 5 and 16 - 12); then distances 5 and 40 from the same key
    assert score(2, 1) == pytest.approx(score(4, 3), abs=1e-4), (
        "q.k after RoPE must depend only on the distance between positions (9-5 == 16-12)"
    )
    assert score(1, 0) != pytest.approx(score(5, 0), abs=1e-4), (
        "q.k after RoPE should change with the distance: positions 5 and 40 gave the same score"
    )


# ---------------------------------------------------------------- top-k / top-p


def _filter_ref(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Boolean keep-mask [B, V], one row at a time in plain Python and float64."""
    B, V = logits.shape
    keep = torch.zeros(B, V, dtype=torch.bool)
    for b in range(B):
        row = logits[b].double().tolist()
        order = sorted(range(V), key=lambda j: -row[j])
        k = V if top_k[b] < 0 else min(top_k[b], V)
        kept = order[:k]
        z = sum(math.exp(row[j] - row[order[0]]) for j in kept)
        mass = 0.0
        for j in kept:
            if mass >= top_p[b]:
                break
            keep[b, j] = True
            mass += math.exp(row[j] - row[order[0]]) / z
    return keep


def _check_filter(logits: torch.Tensor, top_k: list[int], top_p: list[float], why: str) -> None:
    before = logits.clone()
    out = apply_top_k_top_p(logits, torch.tensor(top_k), torch.tensor(top_p))
    assert torch.equal(logits, before), "apply_top_k_top_p must not modify its input: return a new tensor"
    assert isinstance(out, torch.Tensor) and out.shape == logits.shape, (
        f"apply_top_k_top_p must return [B, V] = {tuple(logits.shape)}, got {getattr(out, 'shape', None)}"
    )
    keep = _filter_ref(logits, top_k, top_p)
    got = torch.isfinite(out)
    for b in range(logits.shape[0]):
        assert torch.equal(got[b], keep[b]), (
            f"row {b} (top_k={top_k[b]}, top_p={top_p[b]}): {why}\n"
            f"  expected to keep tokens {keep[b].nonzero().flatten().tolist()}\n"
            f"  kept                    {got[b].nonzero().flatten().tolist()}"
        )
    assert torch.equal(out[keep], logits[keep]), "kept logits must keep their values"
    assert (out[~keep] == -math.inf).all(), "every removed logit must be exactly -inf"


def test_top_k_top_p_disabled_is_identity():
    logits = torch.randn(3, 20, generator=_gen(10))
    out = apply_top_k_top_p(logits, torch.tensor([-1, -1, -1]), torch.tensor([1.0, 1.0, 1.0]))
    assert torch.equal(out, logits), "top_k = -1 and top_p = 1.0 disable both filters: the logits come back unchanged"


def test_top_k_keeps_exactly_k():
    logits = torch.randn(5, 12, generator=_gen(11))
    top_k = [1, 3, 12, -1, 20]
    _check_filter(logits, top_k, [1.0] * 5,
                  "top-k keeps exactly the k largest logits (all of them for k = -1 or k >= V)")
    out = apply_top_k_top_p(logits, torch.tensor(top_k), torch.ones(5))
    counts = torch.isfinite(out).sum(-1).tolist()
    assert counts == [1, 3, 12, 12, 12], f"number of finite logits per row must be min(k, V); got {counts}"


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([[0.05, 0.50, 0.10, 0.20, 0.15]] * 5)  # sorted: .50 .20 .15 .10 .05
    top_p = [0.3, 0.6, 0.8, 0.97, 1e-6]
    _check_filter(probs.log(), [-1] * 5, top_p,
                  "top-p keeps the smallest set of most likely tokens whose probability reaches top_p "
                  "(here: 1, 2, 3, 5 tokens; and never fewer than 1)")
    out = apply_top_k_top_p(probs.log(), torch.full((5,), -1), torch.tensor(top_p))
    counts = torch.isfinite(out).sum(-1).tolist()
    assert counts == [1, 2, 3, 5, 1], f"nucleus sizes for top_p = {top_p} must be [1, 2, 3, 5, 1], got {counts}"


def test_top_k_then_top_p_renormalizes():
    # After top-k = 2, the survivors .4 and .3 renormalize to .57 and .43, so top_p = .5
    # keeps one token. Measured on the unfiltered distribution it would keep two.
    logits = torch.tensor([[0.1, 0.4, 0.2, 0.3]]).log()
    _check_filter(logits, [2], [0.5],
                  "top-p is applied after top-k, to the softmax of the logits top-k kept (renormalized)")


def test_top_k_top_p_random_rows():
    g = _gen(12)
    B, V = 16, 40
    logits = 3 * torch.randn(B, V, generator=g)
    top_k = torch.randint(1, V + 10, (B,), generator=g).tolist()
    top_k[:3] = [-1, -1, V]
    top_p = (0.05 + 0.95 * torch.rand(B, generator=g)).tolist()
    top_p[3:5] = [1.0, 1.0]
    _check_filter(logits, top_k, top_p, "each row uses its own top_k[b] and top_p[b]")


# ---------------------------------------------------------------- sample_next_token


def test_greedy_is_argmax():
    logits = torch.randn(6, 50, generator=_gen(13))
    g = _gen(14)
    state = g.get_state()
    for row in logits:
        tok = sample_next_token(row, 0.0, 5, 0.5, g)
        assert isinstance(tok, int) and not isinstance(tok, bool), (
            f"sample_next_token must return a Python int, got {type(tok).__name__}"
        )
        assert tok == int(row.argmax()), "temperature 0 is greedy: the token must be argmax(logits)"
    assert torch.equal(g.get_state(), state), "greedy decoding must draw no random numbers from the generator"


def test_sampling_is_reproducible():
    logits = torch.randn(30, generator=_gen(15))

    def run(seed: int) -> list[int]:
        g = _gen(seed)
        return [sample_next_token(logits, 1.0, -1, 1.0, g) for _ in range(40)]

    assert run(0) == run(0), "the same seed must give the same tokens: draw only from `generator`"
    assert run(0) != run(1), "different seeds gave identical tokens: is `generator` used for the draw?"
    assert all(isinstance(t, int) and 0 <= t < 30 for t in run(2)), "tokens must be ints in [0, V)"


def test_sampling_stays_inside_filter():
    logits = torch.randn(20, generator=_gen(16))
    top2 = set(logits.topk(2).indices.tolist())
    g = _gen(17)
    seen = {sample_next_token(logits, 2.0, 2, 1.0, g) for _ in range(200)}
    assert seen <= top2, f"with top_k=2 only tokens {sorted(top2)} may be sampled, got {sorted(seen - top2)}"
    assert seen == top2, f"with top_k=2 and temperature 2 both top tokens should appear in 200 draws, saw {sorted(seen)}"


# Critical values of the chi-square distribution at significance 1e-4, by degrees of freedom.
# A correct sampler fails a case with probability 1e-4 for a random seed; the seeds are fixed,
# so every run is deterministic.
_CHI2_CRITICAL = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74}
_DRAWS = 2000


def _rounded(p: torch.Tensor) -> list[float]:
    return [round(v, 3) for v in p.tolist()]


def _target_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    scaled = logits.double()[None] / temperature
    keep = _filter_ref(scaled, [top_k], [top_p])[0]
    return scaled[0].masked_fill(~keep, -math.inf).softmax(-1)


@pytest.mark.parametrize(
    "probs, temperature, top_k, top_p",
    [
        ([0.1, 0.2, 0.3, 0.4], 1.0, -1, 1.0),
        ([0.1, 0.2, 0.3, 0.4], 0.5, -1, 1.0),  # sharper: p ** 2, renormalized
        ([0.05, 0.1, 0.15, 0.2, 0.25, 0.25], 1.5, 4, 1.0),
        ([0.05, 0.5, 0.25, 0.2], 1.0, -1, 0.6),  # nucleus {.5, .25} -> {2/3, 1/3}
    ],
    ids=["plain", "temperature", "top_k", "top_p"],
)
def test_sampling_frequencies(probs, temperature, top_k, top_p):
    logits = torch.tensor(probs).log()
    target = _target_probs(logits, temperature, top_k, top_p)  # [V]
    g = _gen(1234)
    counts = torch.zeros(len(probs), dtype=torch.float64)
    for _ in range(_DRAWS):
        counts[sample_next_token(logits, temperature, top_k, top_p, g)] += 1
    support = target > 0
    assert (counts[~support] == 0).all(), (
        f"tokens {(~support).nonzero().flatten().tolist()} are filtered out and must never be sampled; "
        f"counts {counts.long().tolist()}"
    )
    expected = _DRAWS * target[support]
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    dof = int(support.sum()) - 1
    assert chi2 < _CHI2_CRITICAL[dof], (
        f"sample frequencies {_rounded(counts / _DRAWS)} do not follow softmax(filtered logits / temperature) "
        f"= {_rounded(target)} (chi-square {chi2:.1f} with {dof} degrees of freedom, limit {_CHI2_CRITICAL[dof]})"
    )


# ---------------------------------------------------------------- napkin math

# SmolLM2-135M in bf16: ~134.5M parameters; K and V of 30 layers x 3 heads x 64 dims x 2 bytes.
_PARAMS, _KV = 134_515_008, 2 * 30 * 3 * 64 * 2


def _bytes_ref(num_params, bytes_per_param, kv_bytes_per_token, context_len, batch_size):
    return (num_params * bytes_per_param + batch_size * context_len * kv_bytes_per_token) / batch_size


def test_decode_bytes_batch_of_one():
    got = decode_bytes_per_token(_PARAMS, 2, _KV, 1024, 1)
    expected = _PARAMS * 2 + 1024 * _KV
    assert got == pytest.approx(expected), (
        f"at batch 1 one token costs every weight once plus the sequence's KV cache: "
        f"{_PARAMS} * 2 + 1024 * {_KV} = {expected:.4g} bytes, got {got}"
    )


def test_decode_bytes_formula():
    cases = [(1_000_000, 4, 100, 10, 1), (_PARAMS, 2, _KV, 512, 8), (_PARAMS, 0.5, _KV, 4096, 64), (7e9, 2, 131072, 0, 3)]
    for args in cases:
        got = decode_bytes_per_token(*args)
        assert got == pytest.approx(_bytes_ref(*args)), (
            f"decode_bytes_per_token{args}: (num_params * bytes_per_param + batch_size * context_len * "
            f"kv_bytes_per_token) / batch_size = {_bytes_ref(*args):.6g}, got {got}"
        )


def test_decode_bytes_batching_amortizes_weights():
    per_token = [decode_bytes_per_token(_PARAMS, 2, _KV, 1024, b) for b in (1, 2, 8, 64, 4096)]
    assert all(a > b for a, b in zip(per_token, per_token[1:])), (
        f"a larger batch shares the weight reads, so bytes per token must fall with batch size: {per_token}"
    )
    kv_only = 1024 * _KV
    assert per_token[-1] == pytest.approx(kv_only + _PARAMS * 2 / 4096), (
        "with a huge batch the weights are nearly free and each token costs about its own KV reads"
    )


# ---------------------------------------------------------------- greedy_generate


class _CountingModel:
    """A fake KV-cached model: the next token is (sum of everything fed so far) % V.
    It checks that every call continues exactly where the last one stopped."""

    def __init__(self, V: int = 11):
        self.V, self.fed, self.calls = V, [], []

    def __call__(self, token_ids, start):
        assert start == len(self.fed), (
            f"forward(token_ids, start={start}) but {len(self.fed)} tokens were fed before: start must be that count "
            f"(and no token fed twice)")
        self.calls.append(list(token_ids))
        rows = []
        for t in token_ids:
            self.fed.append(int(t))
            row = torch.zeros(self.V)
            row[sum(self.fed) % self.V] = 1.0
            rows.append(row)
        return torch.stack(rows)


def _greedy_ref(prompt, n, eos, V=11):
    fed, out = list(prompt), []
    while len(out) < n:
        t = sum(fed) % V
        out.append(t)
        if t == eos:
            break
        fed.append(t)
    return out


def test_greedy_generate_feeds_the_prompt_once_then_one_token():
    m = _CountingModel()
    got = greedy_generate(m, [3, 1, 4, 1, 5], 6, eos_token_id=-1)
    assert got == _greedy_ref([3, 1, 4, 1, 5], 6, -1), "the next token is the argmax of the last logits row"
    assert m.calls[0] == [3, 1, 4, 1, 5], "the first call feeds the whole prompt"
    assert all(len(c) == 1 for c in m.calls[1:]), "every later call feeds only the token generated last"
    assert len(m.calls) == 6, "max_new_tokens tokens take exactly that many forwards (the last one is not fed)"


def test_greedy_generate_stops_at_eos_and_keeps_it():
    prompt = [2, 2]
    ref = _greedy_ref(prompt, 50, eos=7)
    assert 7 in ref and len(ref) < 50  # the fake model reaches 7 within a few steps
    assert greedy_generate(_CountingModel(), prompt, 50, eos_token_id=7) == ref, "stop right after EOS, EOS included"


# ---------------------------------------------------------------- questions


@pytest.mark.parametrize("qid", [q.qid for q in quiz.questions(CHAPTER)])
def test_quiz(qid):
    answers = quiz_answers()
    assert isinstance(answers, dict), f"quiz_answers() must return a dict of answers, got {type(answers).__name__}"
    ok, why = quiz.check(CHAPTER, qid, answers.get(qid))
    assert ok, why
