"""Wrong answers to exercises/ch00_the_model.py, each a mistake the contract rules out."""
from __future__ import annotations

import math

import torch

from mutants import mutant

# ---------------------------------------------------------------- rms_norm


@mutant("rms_norm", "the mean is subtracted first, as LayerNorm does")
def _norm_centred(x, weight, eps):
    xf = x.float()
    xf = xf - xf.mean(-1, keepdim=True)
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


@mutant("rms_norm", "eps is added outside the square root: x / (sqrt(mean(x**2)) + eps)")
def _norm_eps_outside(x, weight, eps):
    xf = x.float()
    return (xf / (xf.pow(2).mean(-1, keepdim=True).sqrt() + eps)).to(x.dtype) * weight


@mutant("rms_norm", "the mean of squares is taken in x.dtype: float16 squares above ~256 overflow to inf")
def _norm_squares_in_x_dtype(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@mutant("rms_norm", "the mean is over every element of x, not over the last dim of each row")
def _norm_mean_over_all(x, weight, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean() + eps)).to(x.dtype) * weight


@mutant("rms_norm", "the weight is not applied")
def _norm_no_weight(x, weight, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@mutant("rms_norm", "the result stays in float32 (the statistics' dtype), not x.dtype")
def _norm_stays_float32(x, weight, eps):
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


# ---------------------------------------------------------------- rope_cos_sin


def _cos_sin(angle):
    return angle.cos(), angle.sin()


@mutant("rope_cos_sin", "pair i turns at 1 / theta ** (i / head_dim): the exponent misses its factor 2")
def _rope_exponent_half(positions, head_dim, theta):
    inv_freq = 1.0 / theta ** (torch.arange(head_dim // 2, dtype=torch.float32) / head_dim)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return _cos_sin(torch.cat([freqs, freqs], dim=-1))


@mutant("rope_cos_sin", "each angle is repeated next to itself (interleaved), not in two halves")
def _rope_interleaved(positions, head_dim, theta):
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return _cos_sin(freqs.repeat_interleave(2, dim=-1))


@mutant("rope_cos_sin", "the frequencies are theta ** (2i / head_dim), not their inverse")
def _rope_not_inverted(positions, head_dim, theta):
    freq = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = positions.float()[:, None] * freq[None, :]
    return _cos_sin(torch.cat([freqs, freqs], dim=-1))


@mutant("rope_cos_sin", "positions are counted from 1: position 0 is already rotated")
def _rope_one_based(positions, head_dim, theta):
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = (positions.float() + 1)[:, None] * inv_freq[None, :]
    return _cos_sin(torch.cat([freqs, freqs], dim=-1))


# ---------------------------------------------------------------- apply_rope


def _halves(x):
    half = x.shape[-1] // 2
    return x[..., :half], x[..., half:]


@mutant("apply_rope", "pairs are neighbours (2i, 2i + 1), not halves (i, i + D/2)")
def _rope_neighbour_pairs(x, cos, sin):
    a, b = x[..., 0::2], x[..., 1::2]
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    return torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2).to(x.dtype)


@mutant("apply_rope", "the rotation goes the other way (the sign of sin flipped)")
def _rope_other_way(x, cos, sin):
    a, b = _halves(x)
    rotated = torch.cat([-b, a], dim=-1)
    return (x * cos[:, None, :] - rotated * sin[:, None, :]).to(x.dtype)


@mutant("apply_rope", "rotate_half forgets the minus: cat([x2, x1]) (not a rotation)")
def _rope_no_minus(x, cos, sin):
    a, b = _halves(x)
    return (x * cos[:, None, :] + torch.cat([b, a], dim=-1) * sin[:, None, :]).to(x.dtype)


@mutant("apply_rope", "computed in float32 for precision and never cast back to x.dtype")
def _rope_stays_float32(x, cos, sin):
    xf = x.float()
    a, b = _halves(xf)
    return xf * cos.float()[:, None, :] + torch.cat([-b, a], dim=-1) * sin.float()[:, None, :]


# ---------------------------------------------------------------- apply_top_k_top_p


def _filter(logits, top_k, top_p, *, k_extra=0, renormalize=True, inclusive_mass=False, at_or_below=False,
            first_row_only=False, in_place=False, off_at_one=True):
    """The filter with one knob turned; the defaults follow the contract."""
    out = logits if in_place else logits.clone()
    B, V = logits.shape
    for b in range(B):
        kb = int(top_k[0 if first_row_only else b])
        pb = float(top_p[0 if first_row_only else b])
        k = V if kb < 0 or kb >= V else kb + k_extra
        values, order = logits[b].sort(descending=True)
        keep = torch.arange(V) < k
        probs = (values.masked_fill(~keep, -math.inf) if renormalize else values).softmax(-1)
        before = probs.cumsum(-1) if inclusive_mass else probs.cumsum(-1) - probs
        if pb < 1.0 or not off_at_one:
            keep &= (before <= pb) if at_or_below else (before < pb)
        keep[0] = True
        dropped = order[~keep]
        out[b, dropped] = -math.inf
    return out


@mutant("apply_top_k_top_p", "top-p measures the unfiltered softmax, not the one renormalized over the top-k")
def _topp_not_renormalized(logits, top_k, top_p):
    return _filter(logits, top_k, top_p, renormalize=False)


@mutant("apply_top_k_top_p", "a token is kept while the mass up to and including it is below top_p "
                              "(the token that reaches top_p is dropped)")
def _topp_inclusive_mass(logits, top_k, top_p):
    return _filter(logits, top_k, top_p, inclusive_mass=True)


@mutant("apply_top_k_top_p", "a token whose preceding mass equals top_p exactly is kept (<= instead of <)")
def _topp_at_or_below(logits, top_k, top_p):
    return _filter(logits, top_k, top_p, at_or_below=True)


@mutant("apply_top_k_top_p", "top-k keeps k + 1 logits (rank <= k)")
def _topk_one_more(logits, top_k, top_p):
    return _filter(logits, top_k, top_p, k_extra=1)


@mutant("apply_top_k_top_p", "the input logits are masked in place")
def _filter_in_place(logits, top_k, top_p):
    return _filter(logits, top_k, top_p, in_place=True)


@mutant("apply_top_k_top_p", "the first row's top_k and top_p are used for every row")
def _filter_first_row_params(logits, top_k, top_p):
    return _filter(logits, top_k, top_p, first_row_only=True)


@mutant("apply_top_k_top_p", "top_p 1.0 is not off: a far-tail token whose preceding mass rounds to 1.0 is dropped")
def _filter_top_p_one_not_off(logits, top_k, top_p):
    return _filter(logits, top_k, top_p, off_at_one=False)


# ---------------------------------------------------------------- sample_next_token


def _draw(probs, generator):
    return int(torch.multinomial(probs, 1, generator=generator))


def _filtered_probs(scaled, top_k, top_p):
    if top_k == -1 and top_p >= 1.0:  # both filters off
        return scaled.softmax(-1)
    return _filter(scaled[None], torch.tensor([top_k]), torch.tensor([top_p]))[0].softmax(-1)


@mutant("sample_next_token", "the draw does not use `generator`: the same seed gives other tokens")
def _sample_global_rng(logits, temperature, top_k=-1, top_p=1.0, generator=None):
    if temperature == 0:
        return int(logits.argmax())
    return _draw(_filtered_probs(logits.float() / temperature, top_k, top_p), None)


@mutant("sample_next_token", "the temperature divides the logits after the top-p filter (the nucleus of "
                             "the untempered distribution)")
def _sample_temperature_after_filter(logits, temperature, top_k=-1, top_p=1.0, generator=None):
    if temperature == 0:
        return int(logits.argmax())
    kept = _filter(logits.float()[None], torch.tensor([top_k]), torch.tensor([top_p]))[0]
    return _draw((kept / temperature).softmax(-1), generator)


@mutant("sample_next_token", "top_k and top_p are ignored when sampling")
def _sample_unfiltered(logits, temperature, top_k=-1, top_p=1.0, generator=None):
    if temperature == 0:
        return int(logits.argmax())
    return _draw((logits.float() / temperature).softmax(-1), generator)


@mutant("sample_next_token", "the temperature is ignored: samples from softmax(filtered logits)")
def _sample_no_temperature(logits, temperature, top_k=-1, top_p=1.0, generator=None):
    if temperature == 0:
        return int(logits.argmax())
    return _draw(_filtered_probs(logits.float(), top_k, top_p), generator)


@mutant("sample_next_token", "greedy draws from a one-hot distribution: the argmax, but a random number drawn",
        same_in_engine="the token is the argmax; the generator a greedy row gets is its own request's scratch "
                       "generator, and the engine seeds a generator afresh (noise_seed of the position) for every "
                       "sampled token, so a number drawn on a greedy row reaches no token")
def _sample_greedy_draws(logits, temperature, top_k=-1, top_p=1.0, generator=None):
    if temperature == 0:
        one_hot = torch.zeros_like(logits, dtype=torch.float32)
        one_hot[logits.argmax()] = 1.0
        return _draw(one_hot, generator)
    return _draw(_filtered_probs(logits.float() / temperature, top_k, top_p), generator)


# ---------------------------------------------------------------- decode_bytes_per_token


@mutant("decode_bytes_per_token", "every sequence pays for all the weights (nothing amortized by the batch)")
def _bytes_weights_per_sequence(num_params, bytes_per_param, kv_bytes_per_token, context_len, batch_size):
    return num_params * bytes_per_param + context_len * kv_bytes_per_token


@mutant("decode_bytes_per_token", "the KV cache is read once for the whole batch, like the weights")
def _bytes_kv_shared(num_params, bytes_per_param, kv_bytes_per_token, context_len, batch_size):
    return (num_params * bytes_per_param + context_len * kv_bytes_per_token) / batch_size


@mutant("decode_bytes_per_token", "bytes of the whole step, not divided among the tokens it produces")
def _bytes_per_step(num_params, bytes_per_param, kv_bytes_per_token, context_len, batch_size):
    return num_params * bytes_per_param + batch_size * context_len * kv_bytes_per_token


@mutant("decode_bytes_per_token", "the context counts the token being fed (context_len + 1)")
def _bytes_context_plus_one(num_params, bytes_per_param, kv_bytes_per_token, context_len, batch_size):
    return (num_params * bytes_per_param + batch_size * (context_len + 1) * kv_bytes_per_token) / batch_size


# ---------------------------------------------------------------- greedy_generate


def _generate(forward, prompt_ids, max_new_tokens, eos_token_id, *, row=-1, keep_eos=True, stop_at_eos=True,
              feed_last=False, start_of=lambda fed, out: fed, at_least_one=False):
    """The decode loop with one knob turned; the defaults follow the contract."""
    out, fed, feed = [], 0, list(prompt_ids)
    while len(out) < max_new_tokens or (at_least_one and not out):
        logits = forward(feed, start_of(fed, out))
        fed += len(feed)
        token = int(logits[row].argmax())
        if token == eos_token_id and stop_at_eos:
            if keep_eos:
                out.append(token)
            break
        out.append(token)
        feed = [token]
    if feed_last and out and out[-1] != eos_token_id:
        forward([out[-1]], fed)
    return out


@mutant("greedy_generate", "the EOS token is not included in the result")
def _gen_drops_eos(forward, prompt_ids, max_new_tokens, eos_token_id):
    return _generate(forward, prompt_ids, max_new_tokens, eos_token_id, keep_eos=False)


@mutant("greedy_generate", "generation does not stop at EOS")
def _gen_ignores_eos(forward, prompt_ids, max_new_tokens, eos_token_id):
    return _generate(forward, prompt_ids, max_new_tokens, eos_token_id, stop_at_eos=False)


@mutant("greedy_generate", "the next token is the argmax of the FIRST row of the logits")
def _gen_first_row(forward, prompt_ids, max_new_tokens, eos_token_id):
    return _generate(forward, prompt_ids, max_new_tokens, eos_token_id, row=0)


@mutant("greedy_generate", "the last generated token is fed to the model too (one forward call too many)")
def _gen_feeds_last(forward, prompt_ids, max_new_tokens, eos_token_id):
    return _generate(forward, prompt_ids, max_new_tokens, eos_token_id, feed_last=True)


@mutant("greedy_generate", "start counts the generated tokens only, not the prompt")
def _gen_start_without_prompt(forward, prompt_ids, max_new_tokens, eos_token_id):
    return _generate(forward, prompt_ids, max_new_tokens, eos_token_id,
                     start_of=lambda fed, out: max(len(out) - 1, 0))


@mutant("greedy_generate", "the prompt is fed and one token emitted before the loop, even for max_new_tokens=0")
def _gen_at_least_one(forward, prompt_ids, max_new_tokens, eos_token_id):
    return _generate(forward, prompt_ids, max_new_tokens, eos_token_id, at_least_one=True)
