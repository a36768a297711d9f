// Weight-only quantized linear layers on the CPU: y = x @ w.T with x float32 or bfloat16 and w
// stored as int8 (one scale per output row), or as 8-bit or 4-bit codes with a scale and a
// minimum per group of G weights. The arithmetic is float32: each weight is decoded to a float
// in a register, where it is used at once; nothing dequantized is ever written back to memory.
// bfloat16 activations are widened to float32 as x is copied (exactly), and each y is rounded
// to bfloat16 (to nearest, ties to even, as PyTorch rounds) as it is stored: a bfloat16 call
// gives the float32 call's result on the widened x, rounded once.
//
// Why this pays: a decode step multiplies a few rows of activations (M = 1..32) by every
// weight of the model, so each weight is used only M times after being read from memory. At
// small M the step is bound by how fast the weights stream from memory, not by arithmetic: its
// floor is (bytes of weights) / (memory bandwidth). float32 weights cost 4 bytes each; int8
// costs 1 byte (plus 4 per row for its scale), 8-bit grouped codes 1 byte plus 8 bytes per
// group (1.25 bytes a weight at G = 32), and 4-bit codes half a byte plus 8 bytes per group
// (0.75). Reading 3-5x fewer bytes moves the floor down by as much, provided the decode itself
// is cheap: a few vector instructions for every 16 or 32 weights, shared by all the rows of x
// that use them. (With many rows the arithmetic is the
// floor again, and the same for every format: float32 weights catch up.)
//
// Layouts (every tensor contiguous, row-major):
//   x       float32 or bfloat16 [M, K]   the activations, one row per token
//   y       x's dtype [M, N]             y[m, n] = sum_k x[m, k] w[n, k]
//   int8:   qweight int8 [N, K], scale float32 [N]:   w[n, k] = scale[n] * qweight[n, k]
//   8-bit:  qweight uint8 [N, K], one code 0..255 a weight; scales, mins [N, K/G], both float32
//           or both float16: w[n, k] = q[n, k] * scales[n, k/G] + mins[n, k/G]
//   4-bit:  qweight uint8 [N, K/2]: byte j of a row holds code 2j in its low nibble and code
//           2j+1 in its high nibble (codes 0..15); scales, mins as for 8-bit, the same w
// The int8 row scale multiplies the finished sum. The grouped formats' product splits per
// group g into sum_{k in g} x[m, k] (q[n, k] scales[n, g]) -- the code decoded straight to
// code * scale -- plus mins[n, g] * sum_{k in g} x[m, k], whose second factor does not depend
// on n: the group sums of x are computed once per call (by each thread, with its copy of x).
// The two grouped formats share one kernel (GroupedLinear); they differ only in where a code
// sits (Nibbles, Bytes) and in how a block of them is decoded (Q4Group, U8Group). Groups of
// 32 with a scale and a minimum hold GGUF's Q4_1 weights (4-bit) and its Q8_0 ones (8-bit:
// code c + 128, minimum -128 * scale) exactly. The file stores those scales and minimums as
// float16, so float16 holds them exactly too: then a group costs 4 bytes instead of 8 (4-bit
// codes: 0.625 bytes a weight instead of 0.75), and each is widened to float32 as it is read --
// the same float32 arithmetic, the same results bit for bit, 15% fewer bytes to stream.
//
// Tiling: the rows of x are taken in tiles of up to 8 (a decode step's rows fit in one or a
// few), and each tile is multiplied by NR weight rows at a time: a weight vector is decoded
// once and used for all R rows of the tile, with R x NR accumulators held in registers (NR = 8
// for one row of x, 4 up to four rows, 2 up to eight, so that there are always enough
// independent chains of multiply-adds to keep both FMA units busy). For M <= 8 every weight is
// read from memory once per call. For larger M the weight rows are taken in blocks small
// enough to stay in the L1 cache while every tile of x passes over them. The threads (OpenMP,
// the caller's thread count) split the weight rows into one contiguous range each, and the
// rows a tile will need next are prefetched.
//
// The vector code is chosen when the library is compiled (-march=native): AVX-512 (16 floats
// a vector), AVX2 with FMA (8), or plain scalar code (a "vector" of one float). The kernels
// are written once, over the few operations below.
//
// Rounding: y[m, n] is accumulated lane by lane over K in one fixed order, then its lanes are
// summed in a fixed tree, whatever the tile (R, NR) it was computed in and whichever thread
// computed it: a token's result does not depend on the other rows of the call or on the thread
// count. The summation order differs from PyTorch's, so the results equal the oracle (quant.py's
// *_ref: the weight dequantized, then x @ w.T) within float32 rounding.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if defined(__F16C__) && (defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__)))
#define HAS_F16C 1  // float16 to float32 in hardware (vcvtph2ps)
#else
#define HAS_F16C 0
#endif

namespace {

// ---------------------------------------------------------------- the vector operations
//
// vf: W floats. vzero, vload (W floats), vstore (to an aligned address), vload_first (the first n < W floats, zeros after),
// vadd, vfma(a, b, c) = a * b + c, load_i8 (W int8 as floats), vsum_block (the lane sums of up
// to W vectors); Q4Group: one group's scale, which turns W bytes of 4-bit codes (2W weights)
// into two vectors of weights times the scale, those at even positions and those at odd ones;
// deinterleave, which puts x's values in the same order (once per call); U8Group: the same for
// 2W bytes of 8-bit codes, into the first W weights and the next W (x needs no reordering).
//
// vsum_block sums the lanes of n <= W vectors at once, by a transposed tree: at each stage
// two vectors become one, each half of it the pairwise sums of one of them, lane i plus lane
// i + W/2 (then + W/4, ..., + 1). Every vector's lanes are summed in that one order, whichever
// vectors share the call; a single sum this way costs a third of reducing it on its own.

#if defined(__AVX512F__)

typedef __m512 vf;
constexpr int W = 16;

inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm512_store_ps(p, v); }  // p on a 64-byte boundary
inline vf vload_first(const float* p, int n) {
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1u), p);
}
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf load_i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

inline void vsum_block(const vf* v, int n, float* out) {
    vf a[16], b[8], c[4], d[2];
    for (int i = 0; i < 16; ++i) a[i] = i < n ? v[i] : vzero();
    for (int i = 0; i < 8; ++i)  // lane i + lane i+8 of a[2i] and of a[2i+1]: their 256-bit halves
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 4; ++i)  // + lane i+4: 128-bit quarters, one per vector
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int i = 0; i < 2; ++i)  // + lane i+2, within each quarter
        d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const vf e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),  // + lane i+1
                               _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, e);
    for (int i = 0; i < n; ++i) out[i] = lanes[4 * (i % 4) + i / 4];  // v[4t + q]'s sum: lane 4q + t
}

// The 16 possible codes times the scale as a table: vpermps picks table[q] for each lane, and
// it reads only the low 4 bits of the index, so the low nibble needs no mask and the high one
// only a shift. Decoding and scaling 32 weights is one widening load, a shift and two lookups.
// Lane i holds byte i: codes 2i ("even") and 2i + 1 ("odd").
struct Q4Group {
    vf table;
    Q4Group() = default;
    explicit Q4Group(float scale)
        : table(_mm512_mul_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                              _mm512_set1_ps(scale))) {}
    void decode(const uint8_t* p, vf& even, vf& odd) const {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        even = _mm512_permutexvar_ps(b, table);
        odd = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
    }
};
// 8-bit codes: 16 bytes widened to 16 ints, to float, times the scale. A code block is 32
// bytes: the first 16 weights, then the next 16, in their own order.
struct U8Group {
    vf scale;
    U8Group() = default;
    explicit U8Group(float s) : scale(_mm512_set1_ps(s)) {}
    void decode(const uint8_t* p, vf& first, vf& second) const {
        first = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
                                  reinterpret_cast<const __m128i*>(p)))), scale);
        second = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
                                   reinterpret_cast<const __m128i*>(p + 16)))), scale);
    }
};
// The 32 x values of a code block as the decoded vectors meet them: even positions, then odd.
inline void deinterleave(const float* src, float* dst) {
    const __m512 a = _mm512_loadu_ps(src), b = _mm512_loadu_ps(src + 16);
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    _mm512_storeu_ps(dst, _mm512_permutex2var_ps(a, even, b));
    _mm512_storeu_ps(dst + 16, _mm512_permutex2var_ps(a, _mm512_add_epi32(even, _mm512_set1_epi32(1)), b));
}

#elif defined(__AVX2__) && defined(__FMA__)

typedef __m256 vf;
constexpr int W = 8;

inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm256_store_ps(p, v); }  // p on a 32-byte boundary
inline vf vload_first(const float* p, int n) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lanes));
}
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf load_i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline void vsum_block(const vf* v, int n, float* out) {
    vf a[8], b[4], c[2];
    for (int i = 0; i < 8; ++i) a[i] = i < n ? v[i] : vzero();
    for (int i = 0; i < 4; ++i)  // lane i + lane i+4 of a[2i] and of a[2i+1]: 128-bit halves
        b[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x31));
    for (int i = 0; i < 2; ++i)  // + lane i+2, within each half
        c[i] = _mm256_add_ps(_mm256_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const vf e = _mm256_add_ps(_mm256_shuffle_ps(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),  // + lane i+1
                               _mm256_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, e);
    for (int i = 0; i < n; ++i) out[i] = lanes[4 * (i % 2) + i / 2];  // v[2t + h]'s sum is in lane 4h + t
}

// 8 bytes widened to 8 ints; the low nibble by a mask, the high one by a shift; to float, times
// the scale. Lane i holds byte i: codes 2i ("even") and 2i + 1 ("odd").
struct Q4Group {
    vf scale;
    Q4Group() = default;
    explicit Q4Group(float s) : scale(_mm256_set1_ps(s)) {}
    void decode(const uint8_t* p, vf& even, vf& odd) const {
        const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
        even = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15))), scale);
        odd = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), scale);
    }
};
// 8-bit codes: 8 bytes widened to 8 ints, to float, times the scale; a block is 16 bytes.
struct U8Group {
    vf scale;
    U8Group() = default;
    explicit U8Group(float s) : scale(_mm256_set1_ps(s)) {}
    void decode(const uint8_t* p, vf& first, vf& second) const {
        first = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                                  reinterpret_cast<const __m128i*>(p)))), scale);
        second = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                                   reinterpret_cast<const __m128i*>(p + 8)))), scale);
    }
};
// The 16 x values of a code block as the decoded vectors meet them: even positions, then odd.
inline void deinterleave(const float* src, float* dst) {
    const __m256 a = _mm256_loadu_ps(src), b = _mm256_loadu_ps(src + 8);
    // within each 128-bit half: [a0 a2 b0 b2 | a4 a6 b4 b6]; then the 64-bit pairs reordered
    const __m256 e = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0));
    const __m256 o = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1));
    _mm256_storeu_ps(dst, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), _MM_SHUFFLE(3, 1, 2, 0))));
    _mm256_storeu_ps(dst + 8, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(o), _MM_SHUFFLE(3, 1, 2, 0))));
}

#else  // plain C++: a vector of one float (this file is compiled without FMA contraction)

typedef float vf;
constexpr int W = 1;

inline vf vzero() { return 0.f; }
inline vf vload(const float* p) { return *p; }
inline void vstore(float* p, vf v) { *p = v; }
inline vf vload_first(const float* p, int n) { return n > 0 ? *p : 0.f; }
inline vf vadd(vf a, vf b) { return a + b; }
inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
inline vf load_i8(const int8_t* p) { return static_cast<float>(*p); }
inline void vsum_block(const vf* v, int n, float* out) {
    if (n > 0) out[0] = v[0];
}

struct Q4Group {
    float scale;
    Q4Group() = default;
    explicit Q4Group(float s) : scale(s) {}
    void decode(const uint8_t* p, vf& even, vf& odd) const {
        even = static_cast<float>(*p & 15) * scale;
        odd = static_cast<float>(*p >> 4) * scale;
    }
};
struct U8Group {
    float scale;
    U8Group() = default;
    explicit U8Group(float s) : scale(s) {}
    void decode(const uint8_t* p, vf& first, vf& second) const {
        first = static_cast<float>(p[0]) * scale;
        second = static_cast<float>(p[1]) * scale;
    }
};
inline void deinterleave(const float* src, float* dst) {
    dst[0] = src[0];
    dst[1] = src[1];
}

#endif

// The lane sums of n vectors, W at a time.
template <int n>
inline void vsum_all(const vf* v, float* out) {
    for (int i = 0; i < n; i += W) vsum_block(v + i, n - i < W ? n - i : W, out + i);
}

// A code block of the grouped formats: 2W weights (W bytes of 4-bit codes, 2W of 8-bit ones),
// decoded into two vectors.
constexpr int QBLOCK = 2 * W;

// Scratch memory for x's copy, on a 64-byte boundary (a cache line): with rows a multiple of W
// floats long, no vector load of x straddles two lines (such split loads halve the loop's
// speed). Each thread keeps its own between calls: no allocation per call, and no thread
// reads a copy another core has just written.
float* scratch(int64_t n) {
    struct Buffer {
        float* data = nullptr;
        size_t size = 0;
        ~Buffer() { std::free(data); }
    };
    thread_local Buffer buffer;
    const size_t bytes = (static_cast<size_t>(n) * sizeof(float) + 63) / 64 * 64;
    if (bytes > buffer.size) {
        std::free(buffer.data);
        buffer.data = static_cast<float*>(std::aligned_alloc(64, bytes));
        buffer.size = buffer.data == nullptr ? 0 : bytes;
    }
    return buffer.data;
}

// Weight rows are read PREFETCH_TILES tiles ahead of their use: a tile's NR rows are one
// contiguous stretch of memory, but read NR places at a time, a pattern the hardware
// prefetchers are slow to follow across rows only a few hundred bytes long.
constexpr int PREFETCH_TILES = 2;

// ---------------------------------------------------------------- the activations' dtype

inline float bf16_to_float(uint16_t b) {
    const uint32_t u = static_cast<uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}
inline uint16_t float_to_bf16(float f) {  // to nearest, ties to even; NaN stays NaN (c10::BFloat16's rule)
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// float16 scales and minimums, widened to float32 (exactly) where they are read: one (scalar)
// per group and weight row, W at a time (the minimums' vector).
inline float scalar_of(float v) { return v; }
inline float scalar_of(uint16_t h) {
#if HAS_F16C
    return _cvtsh_ss(h);
#else
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, e = (h >> 10) & 31u, m = h & 1023u;
    uint32_t u;
    if (e == 31) {
        u = sign | 0x7f800000u | (m << 13);  // inf, NaN
    } else if (e != 0) {
        u = sign | ((e + 112u) << 23) | (m << 13);  // normal: rebias 15 -> 127
    } else if (m == 0) {
        u = sign;  // zero
    } else {  // subnormal: m * 2^-24
        float f = static_cast<float>(m) * 5.9604644775390625e-8f;
        std::memcpy(&u, &f, sizeof u);
        u |= sign;
    }
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
#endif
}
inline vf vload_scalars(const float* p, int n) { return n == W ? vload(p) : vload_first(p, n); }
inline vf vload_scalars(const uint16_t* p, int n) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    const __m256i h = n == W ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                             : _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1u), p);
    return _mm512_cvtph_ps(h);
#elif defined(__AVX512F__)
    if (n == W) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    alignas(32) uint16_t first[W] = {};
    std::memcpy(first, p, static_cast<size_t>(n) * sizeof(uint16_t));
    return _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(first)));
#elif HAS_F16C
    if (n == W) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    alignas(16) uint16_t first[W] = {};
    std::memcpy(first, p, static_cast<size_t>(n) * sizeof(uint16_t));
    return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(first)));
#else
    alignas(64) float f[W];
    for (int i = 0; i < W; ++i) f[i] = i < n ? scalar_of(p[i]) : 0.f;
    return vload(f);
#endif
}

// x and y of one call, float32 (bf16 false) or bfloat16: row m of x as float32, and y[i] stored.
struct Rows {
    const void* x;
    void* y;
    bool bf16;
    int64_t K;
    void load(int64_t m, float* dst) const {
        if (!bf16) {
            std::memcpy(dst, static_cast<const float*>(x) + m * K, static_cast<size_t>(K) * sizeof(float));
            return;
        }
        const uint16_t* src = static_cast<const uint16_t*>(x) + m * K;
        for (int64_t k = 0; k < K; ++k) dst[k] = bf16_to_float(src[k]);
    }
    void store(int64_t i, float v) const {
        if (bf16)
            static_cast<uint16_t*>(y)[i] = float_to_bf16(v);
        else
            static_cast<float*>(y)[i] = v;
    }
};

// ---------------------------------------------------------------- int8

struct Int8Linear {
    Rows io;  // x [M, K], y [M, N]
    const int8_t* w;
    const float* scale;
    int64_t M, N, K;
    int64_t Kp;  // K rounded up to a multiple of W: the row length of x as the tiles read it

    // x as the tiles read it, float32 rows of Kp floats (zero-padded) on vector boundaries: x
    // itself where it is that already, else a copy in this thread's scratch; null if out of memory.
    const float* prepare() const {
        if (!io.bf16 && Kp == K && reinterpret_cast<uintptr_t>(io.x) % (W * sizeof(float)) == 0)
            return static_cast<const float*>(io.x);
        float* xp = scratch(M * Kp);
        if (xp == nullptr) return nullptr;
        for (int64_t m = 0; m < M; ++m) {
            io.load(m, xp + m * Kp);
            std::fill(xp + m * Kp + K, xp + (m + 1) * Kp, 0.f);
        }
        return xp;
    }

    // y[m0 .. m0+R, n0 .. n0+NR), from xp = prepare()
    template <int R, int NR>
    void tile(const float* xp, int64_t m0, int64_t n0) const {
        vf acc[R][NR];
        for (int r = 0; r < R; ++r)
            for (int j = 0; j < NR; ++j) acc[r][j] = vzero();
        const int8_t* wr = w + n0 * K;
        const float* xr = xp + m0 * Kp;
        const int64_t full = K / W * W;
        const bool ahead = n0 + (PREFETCH_TILES + 1) * NR <= N;
        for (int64_t k = 0; k < full; k += W) {
            if (ahead && k % 64 == 0)
                for (int j = 0; j < NR; ++j) __builtin_prefetch(wr + (PREFETCH_TILES * NR + j) * K + k);
            vf wv[NR];
            for (int j = 0; j < NR; ++j) wv[j] = load_i8(wr + j * K + k);
            for (int r = 0; r < R; ++r) {
                const vf xv = vload(xr + r * Kp + k);
                for (int j = 0; j < NR; ++j) acc[r][j] = vfma(xv, wv[j], acc[r][j]);
            }
        }
        if (full < K) {  // the last K % W weights of each row, zero-padded to a vector (so is x)
            alignas(64) int8_t tail[NR][W > 8 ? W : 8] = {};
            vf wv[NR];
            for (int j = 0; j < NR; ++j) {
                std::memcpy(tail[j], wr + j * K + full, static_cast<size_t>(K - full));
                wv[j] = load_i8(tail[j]);
            }
            for (int r = 0; r < R; ++r) {
                const vf xv = vload(xr + r * Kp + full);
                for (int j = 0; j < NR; ++j) acc[r][j] = vfma(xv, wv[j], acc[r][j]);
            }
        }
        float sums[R * NR];
        vsum_all<R * NR>(&acc[0][0], sums);
        for (int r = 0; r < R; ++r)
            for (int j = 0; j < NR; ++j) io.store((m0 + r) * N + n0 + j, scale[n0 + j] * sums[r * NR + j]);
    }
};

// ---------------------------------------------------------------- grouped codes: 4-bit and 8-bit

// What differs between the two grouped formats: how many bytes of codes precede weight k of a
// row, the decoder of a group's blocks, and the order x's copy holds a block's values in (the
// order of the two decoded vectors: even and odd positions for 4-bit, first and second half
// for 8-bit).
struct Nibbles {
    typedef Q4Group Group;
    static constexpr int64_t bytes(int64_t k) { return k / 2; }
    static void arrange(const float* src, float* dst, int64_t K) {
        for (int64_t b = 0; b < K; b += QBLOCK) deinterleave(src + b, dst + b);
    }
};
struct Bytes {
    typedef U8Group Group;
    static constexpr int64_t bytes(int64_t k) { return k; }
    static void arrange(const float* src, float* dst, int64_t K) {
        std::memcpy(dst, src, static_cast<size_t>(K) * sizeof(float));
    }
};

// G, the group size, is a compile-time constant: the loop over a group's code blocks has a
// known length (one block at G = 32 with AVX-512) and unrolls. S, the type the scales and
// minimums are stored in: float, or uint16_t for float16.
template <int G, class Codes, class S>
struct GroupedLinear {
    Rows io;  // x [M, K], y [M, N]
    const uint8_t* q;
    const S* scales;
    const S* mins;
    int64_t M, N, K;
    int64_t groups;
    int64_t Gp;  // groups rounded up to a multiple of W

    // In this thread's scratch: x with each block of 2W values in the decoded order ([M, K]),
    // then each group's sum of x ([M, Gp], zero past the last group), then room for one row of
    // x in float32 (bfloat16 x is widened there before it is arranged); null if out of memory.
    const float* prepare() const {
        float* xp = scratch(M * (K + Gp) + K);
        if (xp == nullptr) return nullptr;
        float* xs = xp + M * K;
        float* row = xs + M * Gp;
        for (int64_t m = 0; m < M; ++m) {
            float* xr = xp + m * K;
            const float* src = io.bf16 ? row : static_cast<const float*>(io.x) + m * K;
            if (io.bf16) io.load(m, row);
            Codes::arrange(src, xr, K);
            // A group's sum: its blocks added lane by lane, then the lanes (vsum_block), W groups
            // at a time; a tree of float sums, within a few roundings of the exact sum.
            vf part[W];
            for (int64_t g0 = 0; g0 < groups; g0 += W) {
                const int n = static_cast<int>(std::min<int64_t>(W, groups - g0));
                for (int i = 0; i < n; ++i) {
                    const float* p = xr + (g0 + i) * G;
                    part[i] = vadd(vload(p), vload(p + W));
                    for (int64_t b = QBLOCK; b < G; b += QBLOCK)
                        part[i] = vadd(part[i], vadd(vload(p + b), vload(p + b + W)));
                }
                vsum_block(part, n, xs + m * Gp + g0);
            }
            std::fill(xs + m * Gp + groups, xs + (m + 1) * Gp, 0.f);
        }
        return xp;
    }

    template <int R, int NR>
    void tile(const float* xp, int64_t m0, int64_t n0) const {
        typedef typename Codes::Group Group;
        vf acc[R][NR];
        for (int r = 0; r < R; ++r)
            for (int j = 0; j < NR; ++j) acc[r][j] = vzero();
        const int64_t row_bytes = Codes::bytes(K);
        const uint8_t* qr = q + n0 * row_bytes;
        const float* xr = xp + m0 * K;
        const bool ahead = n0 + (PREFETCH_TILES + 1) * NR <= N;
        // float16 scales are widened W groups at a time, into a buffer the groups then read
        alignas(64) float widened[std::is_same<S, float>::value ? 1 : NR][W];
        const float* scale_of[NR];
        for (int64_t g0 = 0; g0 < groups; g0 += W) {
            const int n = static_cast<int>(std::min<int64_t>(W, groups - g0));
            for (int j = 0; j < NR; ++j) {
                if constexpr (std::is_same<S, float>::value) {
                    scale_of[j] = scales + (n0 + j) * groups + g0;
                } else {
                    vstore(widened[j], vload_scalars(scales + (n0 + j) * groups + g0, n));
                    scale_of[j] = widened[j];
                }
            }
            for (int64_t g = g0; g < g0 + n; ++g) {
                Group group[NR];
                for (int j = 0; j < NR; ++j) group[j] = Group(scale_of[j][g - g0]);
                for (int64_t k = g * G; k < (g + 1) * G; k += QBLOCK) {
                    const int64_t kb = Codes::bytes(k);
                    if (ahead && kb % 64 == 0)  // 64 bytes of codes
                        for (int j = 0; j < NR; ++j)
                            __builtin_prefetch(qr + (PREFETCH_TILES * NR + j) * row_bytes + kb);
                    vf even[NR], odd[NR];
                    for (int j = 0; j < NR; ++j) group[j].decode(qr + j * row_bytes + kb, even[j], odd[j]);
                    for (int r = 0; r < R; ++r) {
                        const vf xe = vload(xr + r * K + k), xo = vload(xr + r * K + k + W);
                        for (int j = 0; j < NR; ++j) acc[r][j] = vfma(xo, odd[j], vfma(xe, even[j], acc[r][j]));
                    }
                }
            }
        }
        // + sum_g mins[n, g] * xsum[m, g], W groups at a time (xsum is zero past the last group)
        const float* xsum = xp + M * K;
        for (int64_t g = 0; g < groups; g += W) {
            const int n = static_cast<int>(std::min<int64_t>(W, groups - g));
            vf mv[NR];
            for (int j = 0; j < NR; ++j) mv[j] = vload_scalars(mins + (n0 + j) * groups + g, n);
            for (int r = 0; r < R; ++r) {
                const vf s = vload(xsum + (m0 + r) * Gp + g);
                for (int j = 0; j < NR; ++j) acc[r][j] = vfma(s, mv[j], acc[r][j]);
            }
        }
        float sums[R * NR];
        vsum_all<R * NR>(&acc[0][0], sums);
        for (int r = 0; r < R; ++r)
            for (int j = 0; j < NR; ++j) io.store((m0 + r) * N + n0 + j, sums[r * NR + j]);
    }
};

// ---------------------------------------------------------------- the loop over tiles

constexpr int MAX_R = 8;                   // rows of x in a tile
constexpr int64_t BLOCK_BYTES = 32768;     // weight rows revisited by every tile: an L1's worth
constexpr int64_t PARALLEL_WORK = 131072;  // fewer multiply-adds than this: on the calling thread

// Weight rows per step for a tile of R rows of x: at least 8 accumulators (independent
// multiply-add chains), at most 16 (registers).
template <int R>
constexpr int weight_rows() {
    return R == 1 ? 8 : (R <= 4 ? 4 : 2);
}

template <int R, class Kernel>
void tile_columns(const Kernel& kernel, const float* xp, int64_t m0, int64_t n0, int64_t n1) {
    constexpr int NR = weight_rows<R>();
    int64_t n = n0;
    for (; n + NR <= n1; n += NR) kernel.template tile<R, NR>(xp, m0, n);
    for (; n < n1; ++n) kernel.template tile<R, 1>(xp, m0, n);
}

template <class Kernel>
void tile_rows(const Kernel& kernel, const float* xp, int R, int64_t m0, int64_t n0, int64_t n1) {
    switch (R) {
        case 1: tile_columns<1>(kernel, xp, m0, n0, n1); break;
        case 2: tile_columns<2>(kernel, xp, m0, n0, n1); break;
        case 3: tile_columns<3>(kernel, xp, m0, n0, n1); break;
        case 4: tile_columns<4>(kernel, xp, m0, n0, n1); break;
        case 5: tile_columns<5>(kernel, xp, m0, n0, n1); break;
        case 6: tile_columns<6>(kernel, xp, m0, n0, n1); break;
        case 7: tile_columns<7>(kernel, xp, m0, n0, n1); break;
        default: tile_columns<8>(kernel, xp, m0, n0, n1); break;
    }
}

// Every y[m, n]: the N weight rows split into one contiguous range per thread (a multiple of 8
// rows each); each thread prepares its own x, then walks its range in blocks of weight rows,
// each block by every tile of x. Returns 0, or 7 where a thread's scratch cannot be allocated.
template <class Kernel>
int run(const Kernel& kernel, int64_t row_bytes, int num_threads) {
    const int64_t M = kernel.M, N = kernel.N;
    const int parts = num_threads > 1 && M * N * kernel.K >= PARALLEL_WORK ? num_threads : 1;
    const int64_t per_part = ((N + parts - 1) / parts + 7) / 8 * 8;
    const int64_t block = std::max<int64_t>(8, BLOCK_BYTES / row_bytes / 8 * 8);
    int failed = 0;
#pragma omp parallel for schedule(static, 1) num_threads(parts) if (parts > 1) reduction(|| : failed)
    for (int part = 0; part < parts; ++part) {
        const int64_t first = std::min(N, part * per_part), last = std::min(N, first + per_part);
        if (first == last) continue;
        const float* xp = kernel.prepare();
        if (xp == nullptr) {
            failed = 1;
            continue;
        }
        for (int64_t b = first; b < last; b += block) {
            const int64_t b1 = std::min(last, b + block);
            for (int64_t m0 = 0; m0 < M; m0 += MAX_R)
                tile_rows(kernel, xp, static_cast<int>(std::min<int64_t>(MAX_R, M - m0)), m0, b, b1);
        }
    }
    return failed ? 7 : 0;
}

// One of the grouped formats at its group size (32, 64 or 128, dividing K); 2 otherwise.
template <class Codes, class S>
int run_grouped(const Rows& io, const uint8_t* qweight, const S* scales, const S* mins,
                int64_t M, int64_t N, int64_t K, int group_size, int threads) {
    if ((group_size != 32 && group_size != 64 && group_size != 128) || K % group_size != 0) return 2;
    const int64_t groups = K / group_size, Gp = (groups + W - 1) / W * W, row_bytes = Codes::bytes(K);
    if (group_size == 32)
        return run(GroupedLinear<32, Codes, S>{io, qweight, scales, mins, M, N, K, groups, Gp}, row_bytes, threads);
    if (group_size == 64)
        return run(GroupedLinear<64, Codes, S>{io, qweight, scales, mins, M, N, K, groups, Gp}, row_bytes, threads);
    return run(GroupedLinear<128, Codes, S>{io, qweight, scales, mins, M, N, K, groups, Gp}, row_bytes, threads);
}

// The scales' type: 0 float32, 1 float16 (the minimums share it).
template <class Codes>
int run_grouped(int dtype, const void* x, const uint8_t* qweight, const void* scales, const void* mins,
                int scale_dtype, void* y, int64_t M, int64_t N, int64_t K, int group_size, int threads) {
    if (M < 1 || N < 1 || K < 1) return 1;
    if ((dtype != 0 && dtype != 1) || (scale_dtype != 0 && scale_dtype != 1)) return 3;
    const Rows io{x, y, dtype == 1, K};
    if (scale_dtype == 1)
        return run_grouped<Codes>(io, qweight, static_cast<const uint16_t*>(scales), static_cast<const uint16_t*>(mins),
                                  M, N, K, group_size, threads);
    return run_grouped<Codes>(io, qweight, static_cast<const float*>(scales), static_cast<const float*>(mins),
                              M, N, K, group_size, threads);
}

}  // namespace

extern "C" {

// dtype: the activations' (x's and y's) type, 0 float32 or 1 bfloat16 (build.DTYPE_CODES).

// y [M, N] = x [M, K] times the int8 weight [N, K] with its row scales [N], transposed.
// Returns 0, 1 for a size below 1, 3 for an unknown dtype, 7 where the scratch copy of x
// cannot be allocated.
int minillm_int8_linear(int dtype, const void* x, const int8_t* qweight, const float* scale, void* y, int64_t M,
                        int64_t N, int64_t K, int num_threads) {
    if (M < 1 || N < 1 || K < 1) return 1;
    if (dtype != 0 && dtype != 1) return 3;
    const Int8Linear kernel{Rows{x, y, dtype == 1, K}, qweight, scale, M, N, K, (K + W - 1) / W * W};
    return run(kernel, K, num_threads);
}

// y [M, N] = x [M, K] times the 4-bit weight (qweight [N, K/2], scales and mins [N, K/G] in
// float32, scale_dtype 0, or float16, 1), transposed. Returns 0, 1 for a size below 1, 2 for a
// group size other than 32, 64 or 128 or a K that is not a multiple of it, 3 for an unknown
// dtype, 7 where the scratch copy of x cannot be allocated.
int minillm_q4_linear(int dtype, const void* x, const uint8_t* qweight, const void* scales, const void* mins,
                      int scale_dtype, void* y, int64_t M, int64_t N, int64_t K, int group_size, int threads) {
    return run_grouped<Nibbles>(dtype, x, qweight, scales, mins, scale_dtype, y, M, N, K, group_size, threads);
}

// y [M, N] = x [M, K] times the 8-bit grouped weight (qweight [N, K], one code 0..255 a byte;
// scales and mins [N, K/G] as for minillm_q4_linear), transposed. Returns as minillm_q4_linear.
int minillm_u8_linear(int dtype, const void* x, const uint8_t* qweight, const void* scales, const void* mins,
                      int scale_dtype, void* y, int64_t M, int64_t N, int64_t K, int group_size, int threads) {
    return run_grouped<Bytes>(dtype, x, qweight, scales, mins, scale_dtype, y, M, N, K, group_size, threads);
}

}
