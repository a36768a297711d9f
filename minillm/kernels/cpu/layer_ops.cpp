// The elementwise work between a decoder layer's matrix products, on the CPU, one call each:
// RMSNorm (with the residual add before it), RoPE with the K/V cache write, and SwiGLU's
// silu(gate) * up. In eager PyTorch these are some forty small ops a layer (a norm alone is
// ten: square, mean, add, rsqrt, multiply, casts); at a few tokens a step each op costs more
// to dispatch than to compute, and a 30-layer step of SmolLM2 spends milliseconds on them.
//
// The numbers are model.py's, rounded where model.py rounds: every product and sum that
// PyTorch rounds to bfloat16 is rounded here at the same point (round to nearest even), and
// float32 products and sums are not fused into FMAs (this file is compiled with
// -ffp-contract=off, without -ffast-math). Two things differ by float rounding only: the sum
// of squares of a norm (16 partial sums here, PyTorch's own order there) and exp in silu
// (a polynomial here, PyTorch's vectorized exp there). Every token is computed on its own, so a
// token's bits do not depend on the other tokens of the step or on the thread count.
//
// Layouts: every tensor is contiguous, a row per token. The oracle is model.py's eager forward
// (tests/test_cpu_layer_ops.py).
#include <cmath>
#include <cstdint>
#include <cstring>

#include "elements.h"

namespace {

using minillm::bf16;
using minillm::load;
using minillm::round_to;
using minillm::store;

// exp(x) for float32 to about 1 ulp, in plain arithmetic so that the loops that call it
// vectorize (libm's expf is a call per element): x = n ln2 + r, |r| <= ln2 / 2, a degree-7
// polynomial for exp(r) (Cephes' expf coefficients), times 2^n built in the exponent bits.
// Past the largest float it is infinity, as expf is (silu of a very negative x is then -0).
inline float exp_approx(float x) {
    const bool overflows = x > 88.7228394f;
    x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
    const float n = std::floor(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.f;
    const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    return overflows ? __builtin_inff() : p * scale;
}

// Below this many tokens a call runs on the calling thread: a decode step's few rows are
// microseconds of work, less than waking the thread pool.
constexpr int64_t PARALLEL_TOKENS = 64;

// h = x + res (when res is given) in T's rounding; n = weight * (h / rms(h)), with h / rms(h)
// computed in float32 and rounded to T before the weight multiplies it (model.rms_norm).
template <typename T>
void add_rms_norm(const T* x, const T* res, T* h_out, T* n_out, const T* w, int64_t rows, int64_t D, float eps,
                  int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= PARALLEL_TOKENS)
    for (int64_t t = 0; t < rows; ++t) {
        const T* xr = x + t * D;
        T* hr = h_out + t * D;
        float part[16] = {0.f};
        if (res != nullptr) {
            const T* rr = res + t * D;
            for (int64_t d = 0; d < D; ++d) {
                store(hr, d, load(xr, d) + load(rr, d));
            }
        } else if (hr != xr) {
            std::memcpy(hr, xr, D * sizeof(T));
        }
        int64_t d = 0;
        for (; d + 16 <= D; d += 16)
            for (int j = 0; j < 16; ++j) {
                const float h = load(hr, d + j);
                part[j] += h * h;
            }
        for (; d < D; ++d) {
            const float h = load(hr, d);
            part[d % 16] += h * h;
        }
        float sum = 0.f;
        for (int j = 0; j < 16; ++j) sum += part[j];
        const float r = 1.f / std::sqrt(sum / static_cast<float>(D) + eps);
        T* nr = n_out + t * D;
        for (int64_t e = 0; e < D; ++e) {
            const float y = round_to(T(), load(hr, e) * r);
            store(nr, e, load(w, e) * y);
        }
    }
}

// out[t, f] = silu(gate) * up for gate_up[t] = [gate (F) | up (F)], each product rounded to T.
template <typename T>
void silu_mul(const T* gate_up, T* out, int64_t rows, int64_t F, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= PARALLEL_TOKENS)
    for (int64_t t = 0; t < rows; ++t) {
        const T* g = gate_up + t * 2 * F;
        const T* u = g + F;
        T* o = out + t * F;
        for (int64_t f = 0; f < F; ++f) {
            const float x = load(g, f);
            const float s = round_to(T(), x / (1.f + exp_approx(-x)));
            store(o, f, s * load(u, f));
        }
    }
}

// One head of D values rotated by RoPE ("rotate half"): y[d] = x[d] * cos[d] + r[d] * sin[d],
// r = (-x[D/2:], x[:D/2]); each product and the sum rounded to T (model.apply_rope).
template <typename T>
inline void rope_head(const T* x, const T* cos, const T* sin, T* y, int D) {
    const int half = D / 2;
    for (int d = 0; d < half; ++d) {
        const float a = round_to(T(), load(x, d) * load(cos, d));
        const float b = round_to(T(), -load(x, d + half) * load(sin, d));
        store(y, d, a + b);
    }
    for (int d = half; d < D; ++d) {
        const float a = round_to(T(), load(x, d) * load(cos, d));
        const float b = round_to(T(), load(x, d - half) * load(sin, d));
        store(y, d, a + b);
    }
}

// qkv [T, (Hq + 2 Hkv) D] as the fused projection gives it: q heads, k heads, v heads.
// q_out [T, Hq, D] gets the rotated queries; the rotated keys and the values go to the
// caches' rows `slots[t]` ([num_slots, Hkv, D] each).
template <typename T>
void rope_write(const T* qkv, const T* cos, const T* sin, const int64_t* slots, T* q_out, T* k_cache, T* v_cache,
                int64_t rows, int Hq, int Hkv, int D, int num_threads) {
    const int64_t width = static_cast<int64_t>(Hq + 2 * Hkv) * D, kv = static_cast<int64_t>(Hkv) * D;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= PARALLEL_TOKENS)
    for (int64_t t = 0; t < rows; ++t) {
        const T* x = qkv + t * width;
        const T* c = cos + t * D;
        const T* s = sin + t * D;
        for (int h = 0; h < Hq; ++h) rope_head(x + h * D, c, s, q_out + (t * Hq + h) * D, D);
        T* k = k_cache + slots[t] * kv;
        for (int h = 0; h < Hkv; ++h) rope_head(x + (Hq + h) * D, c, s, k + h * D, D);
        std::memcpy(v_cache + slots[t] * kv, x + (Hq + Hkv) * D, kv * sizeof(T));
    }
}

}  // namespace

extern "C" {

// dtype: 0 float32, 1 bfloat16, for every tensor of a call. res may be null (a norm without
// the residual add; h_out then receives a copy of x, unless it is x). Returns 0, or 3 for an
// unknown dtype.
int minillm_add_rms_norm(int dtype, const void* x, const void* res, void* h_out, void* n_out, const void* w,
                         int64_t rows, int64_t D, float eps, int num_threads) {
    if (dtype == 0)
        add_rms_norm(static_cast<const float*>(x), static_cast<const float*>(res), static_cast<float*>(h_out),
                     static_cast<float*>(n_out), static_cast<const float*>(w), rows, D, eps, num_threads);
    else if (dtype == 1)
        add_rms_norm(static_cast<const bf16*>(x), static_cast<const bf16*>(res), static_cast<bf16*>(h_out),
                     static_cast<bf16*>(n_out), static_cast<const bf16*>(w), rows, D, eps, num_threads);
    else
        return 3;
    return 0;
}

int minillm_silu_mul(int dtype, const void* gate_up, void* out, int64_t rows, int64_t F, int num_threads) {
    if (dtype == 0)
        silu_mul(static_cast<const float*>(gate_up), static_cast<float*>(out), rows, F, num_threads);
    else if (dtype == 1)
        silu_mul(static_cast<const bf16*>(gate_up), static_cast<bf16*>(out), rows, F, num_threads);
    else
        return 3;
    return 0;
}

// Returns 0; 3 for an unknown dtype; 6 where a slot lies outside the cache (checked for every
// token before anything is written).
int minillm_rope_write(int dtype, const void* qkv, const void* cos, const void* sin, const int64_t* slots,
                       void* q_out, void* k_cache, void* v_cache, int64_t num_slots, int64_t rows, int Hq, int Hkv,
                       int D, int num_threads) {
    for (int64_t t = 0; t < rows; ++t)
        if (slots[t] < 0 || slots[t] >= num_slots) return 6;
    if (dtype == 0)
        rope_write(static_cast<const float*>(qkv), static_cast<const float*>(cos), static_cast<const float*>(sin),
                   slots, static_cast<float*>(q_out), static_cast<float*>(k_cache), static_cast<float*>(v_cache),
                   rows, Hq, Hkv, D, num_threads);
    else if (dtype == 1)
        rope_write(static_cast<const bf16*>(qkv), static_cast<const bf16*>(cos), static_cast<const bf16*>(sin),
                   slots, static_cast<bf16*>(q_out), static_cast<bf16*>(k_cache), static_cast<bf16*>(v_cache), rows,
                   Hq, Hkv, D, num_threads);
    else
        return 3;
    return 0;
}

}
