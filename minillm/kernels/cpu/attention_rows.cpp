// Attention on the CPU: every row of a step has one query and attends over its sequence's
// cached keys, read through the block table once, in one call for the whole step. A decode row
// is one such row; a prefill, a chunk or drafts to verify come as one row per query, each with
// its own number of keys (attention.cpu_attention_rows: the causal mask, by construction).
//
// Why a kernel of its own: the work of one row is small (at 800 keys, SmolLM2 reads ~1.2 MB of
// K/V and does ~2 MFLOP per layer), and torch spells it as a gather plus small matrix products
// whose fixed costs are several times the work itself. Here a row's keys are streamed once:
// scores for the query heads that share a KV head, softmax, then the weighted sum of V.
//
// Layouts (as minillm/attention.py): q and out [tokens, Hq, D] with a token stride; caches
// [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks] int32; query head h reads KV
// head h / group. A row's keys are cut into chunks of CHUNK keys (split-K, "flash decoding"),
// so a single long row still keeps every thread busy; the chunks are combined by their
// running max and sum. A row's result depends only on its own query, keys and length, never
// on the other rows of the step: the same row alone or in a batch gives the same bits.
//
// Candidate trees (speculative verification of a Medusa tree): a row may also carry a tree
// mask, tree_start and a 64-bit set tree_bits, and then reads key j only if j < tree_start or
// bit j - tree_start is set (the nodes of a tree sit after their root; a node sees its
// ancestors and itself). Only a chunk that holds keys at or past tree_start runs the masked
// loop (chunk_attention<..., true>); every other chunk, and every row of a step without trees,
// runs the same code as without the mask, so it gives the same bits.
//
// The oracle is kernels/paged_decode_attention.py's paged_attention_ref, and the torch backend
// is held to it as well (tests/test_cpu_attention.py).
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "elements.h"

namespace {

constexpr int CHUNK = 256;   // keys per task
constexpr int MAX_GROUP = 16;
constexpr int MAX_D = 256;

using minillm::bf16;
using minillm::load;
using minillm::store;

struct Task {
    int row;    // index into the rows list
    int kvh;    // KV head
    int first;  // first key of the chunk
    int last;   // one past its last key
    int slot;   // where its partial result goes
};

// Ask for the next block's rows of this head while this block is read: blocks lie anywhere in
// the cache, where the hardware prefetcher, which follows addresses in order, cannot guess them.
template <typename T>
inline void prefetch_block(const T* cache, int32_t blk, int block_size, int64_t tok_stride, int64_t head_off, int D) {
    const char* base = reinterpret_cast<const char*>(cache + static_cast<int64_t>(blk) * block_size * tok_stride + head_off);
    const int64_t row_bytes = static_cast<int64_t>(D) * sizeof(T), stride = tok_stride * sizeof(T);
    const int rows = std::min(block_size, 64);
    for (int j = 0; j < rows; ++j)
        for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(base + j * stride + b);
}

// Keys t .. t + *run - 1 of a row (of keys up to `last`) lie in one block: a pointer to key t's
// head `head_off`, the next key `tok_stride` further. The next block's rows are prefetched.
template <typename T>
inline const T* block_run(const T* cache, const int32_t* table, int t, int last, int block_size, int64_t tok_stride,
                          int64_t head_off, int D, int* run) {
    const int off = t % block_size;
    *run = std::min(block_size - off, last - t);
    if (t + *run < last) prefetch_block(cache, table[(t + *run) / block_size], block_size, tok_stride, head_off, D);
    return cache + (static_cast<int64_t>(table[t / block_size]) * block_size + off) * tok_stride + head_off;
}

// Whether a row with tree mask (tree_start, bits) reads key j: before the tree, or its bit set
// (a key 64 or more past tree_start has no bit: masked, as the oracle's tree_key_mask).
inline bool tree_sees(int64_t j, int64_t tree_start, uint64_t bits) {
    const int64_t off = j - tree_start;
    return off < 0 || (off < 64 && ((bits >> off) & 1u));
}

// Partial result of one chunk for the `group` query heads of one KV head:
// m[g] the largest score, l[g] the sum of exp(score - m), acc[g][D] the exp-weighted sum of V.
// G and D are compile-time for the common shapes (the loops unroll and the accumulators stay
// in registers); 0 means read them from `group` and `head_dim` at run time.
// TREE: the keys the row's tree mask (tree_start, bits) hides get no weight; a chunk whose
// keys are all hidden gives m = -FLT_MAX, l = 0 and acc = 0 (no weight in the combine).
template <typename T, int G, int DD, bool TREE>
void chunk_attention(const T* q, const T* k_cache, const T* v_cache, const int32_t* table,
                     int block_size, int Hkv, int group_, int head_dim, int kvh, int first, int last,
                     float scale, float* m, float* l, float* acc, int64_t tree_start, uint64_t bits) {
    const int group = G ? G : group_;
    const int D = DD ? DD : head_dim;
    alignas(64) float qf[G ? G : MAX_GROUP][DD ? DD : MAX_D];
    for (int g = 0; g < group; ++g)
        for (int d = 0; d < D; ++d) qf[g][d] = load(q, (kvh * group + g) * D + d) * scale;
    alignas(64) float s[G ? G : MAX_GROUP][CHUNK];
    const int n = last - first;
    const int64_t tok_stride = static_cast<int64_t>(Hkv) * D;
    // pass 1: scores, block by block
    for (int t = first; t < last;) {
        int run;
        const T* kp = block_run(k_cache, table, t, last, block_size, tok_stride, kvh * D, D, &run);
        float* sj = &s[0][t - first];
        for (int j = 0; j < run; ++j, kp += tok_stride) {
            alignas(64) float kf[DD ? DD : MAX_D];
            for (int d = 0; d < D; ++d) kf[d] = load(kp, d);
            for (int g = 0; g < group; ++g) {
                float dot = 0.f;
                for (int d = 0; d < D; ++d) dot += qf[g][d] * kf[d];
                sj[g * CHUNK + j] = dot;
            }
        }
        t += run;
    }
    // pass 2: softmax numerators
    if constexpr (TREE) {  // over the keys the mask lets the row see; the others weigh 0
        bool seen[CHUNK];
        for (int j = 0; j < n; ++j) seen[j] = tree_sees(first + j, tree_start, bits);
        for (int g = 0; g < group; ++g) {
            float mx = -FLT_MAX;
            for (int j = 0; j < n; ++j)
                if (seen[j]) mx = std::max(mx, s[g][j]);
            float sum = 0.f;
            for (int j = 0; j < n; ++j) {
                s[g][j] = seen[j] ? std::exp(s[g][j] - mx) : 0.f;
                sum += s[g][j];
            }
            m[g] = mx;
            l[g] = sum;
        }
    } else {
        for (int g = 0; g < group; ++g) {
            float mx = s[g][0];
            for (int j = 1; j < n; ++j) mx = std::max(mx, s[g][j]);
            float sum = 0.f;
            for (int j = 0; j < n; ++j) {
                s[g][j] = std::exp(s[g][j] - mx);
                sum += s[g][j];
            }
            m[g] = mx;
            l[g] = sum;
        }
    }
    // pass 3: weighted sum of V
    alignas(64) float a[G ? G : MAX_GROUP][DD ? DD : MAX_D];
    for (int g = 0; g < group; ++g)
        for (int d = 0; d < D; ++d) a[g][d] = 0.f;
    for (int t = first; t < last;) {
        int run;
        const T* vp = block_run(v_cache, table, t, last, block_size, tok_stride, kvh * D, D, &run);
        const float* pj = &s[0][t - first];
        for (int j = 0; j < run; ++j, vp += tok_stride) {
            alignas(64) float vf[DD ? DD : MAX_D];
            for (int d = 0; d < D; ++d) vf[d] = load(vp, d);
            for (int g = 0; g < group; ++g) {
                const float p = pj[g * CHUNK + j];
                for (int d = 0; d < D; ++d) a[g][d] += p * vf[d];
            }
        }
        t += run;
    }
    for (int g = 0; g < group; ++g)
        for (int d = 0; d < D; ++d) acc[g * D + d] = a[g][d];
}

template <typename T, bool TREE>
void chunk_dispatch(const T* q, const T* k_cache, const T* v_cache, const int32_t* table, int block_size, int Hkv,
                    int group, int D, int kvh, int first, int last, float scale, float* m, float* l, float* acc,
                    int64_t tree_start, uint64_t bits) {
    if (group == 3 && D == 64)  // SmolLM2-135M
        chunk_attention<T, 3, 64, TREE>(q, k_cache, v_cache, table, block_size, Hkv, group, D, kvh, first, last,
                                        scale, m, l, acc, tree_start, bits);
    else if (D == 64)
        chunk_attention<T, 0, 64, TREE>(q, k_cache, v_cache, table, block_size, Hkv, group, D, kvh, first, last,
                                        scale, m, l, acc, tree_start, bits);
    else if (D == 128)
        chunk_attention<T, 0, 128, TREE>(q, k_cache, v_cache, table, block_size, Hkv, group, D, kvh, first, last,
                                         scale, m, l, acc, tree_start, bits);
    else
        chunk_attention<T, 0, 0, TREE>(q, k_cache, v_cache, table, block_size, Hkv, group, D, kvh, first, last,
                                       scale, m, l, acc, tree_start, bits);
}

// Whether a row of `ctx` keys with tree mask (tree_start, bits) sees at least one of them.
inline bool tree_sees_a_key(int ctx, int64_t tree_start, uint64_t bits) {
    if (tree_start > 0) return true;  // key 0 lies before the tree
    const int64_t lo = -tree_start, hi = std::min<int64_t>(64, ctx - tree_start);  // bits of keys 0 .. ctx - 1
    if (lo >= hi) return false;
    const uint64_t below_hi = hi == 64 ? ~uint64_t{0} : (uint64_t{1} << hi) - 1;
    return (bits & below_hi) >> lo != 0;
}

struct Shape {
    int64_t num_tokens, num_seqs, max_blocks, num_blocks;
};

template <typename T>
int run(const T* q, int64_t q_stride, T* out, int64_t out_stride, const T* k_cache, const T* v_cache,
        int block_size, int Hkv, int group, int D, const int32_t* block_tables, int64_t bt_stride,
        const int32_t* context_lens, const int64_t* rows, int num_rows, float scale, int num_threads, Shape shape,
        const int32_t* tree_start, const uint64_t* tree_bits) {
    if (group < 1 || group > MAX_GROUP || D < 1 || D > MAX_D || block_size < 1) return 1;
    std::vector<Task> tasks;
    std::vector<int> row_slot(num_rows + 1, 0);  // first partial slot of each row
    for (int r = 0; r < num_rows; ++r) {  // every index checked before any thread reads memory
        const int64_t b = rows[2 * r], tok = rows[2 * r + 1];
        if (b < 0 || b >= shape.num_seqs || tok < 0 || tok >= shape.num_tokens) return 4;
        const int ctx = context_lens[b];
        if (ctx < 1) return 2;
        if (tree_start && !tree_sees_a_key(ctx, tree_start[r], tree_bits[r])) return 6;
        const int64_t used = (ctx + block_size - 1) / block_size;
        if (used > shape.max_blocks) return 5;
        for (int64_t j = 0; j < used; ++j) {
            const int32_t blk = block_tables[b * bt_stride + j];
            if (blk < 0 || blk >= shape.num_blocks) return 5;
        }
        const int chunks = (ctx + CHUNK - 1) / CHUNK;
        // a row of one chunk is finished by its task; the chunks of a longer row meet in `partial`
        row_slot[r + 1] = row_slot[r] + (chunks > 1 ? chunks * Hkv : 0);
        for (int h = 0; h < Hkv; ++h)
            for (int c = 0; c < chunks; ++c)
                tasks.push_back({r, h, c * CHUNK, std::min(ctx, (c + 1) * CHUNK),
                                 chunks > 1 ? row_slot[r] + h * chunks + c : -1});
    }
    const int num_slots = row_slot[num_rows];
    const int per_slot = group * (D + 2);
    std::vector<float> partial(static_cast<size_t>(num_slots) * per_slot);
    const int num_tasks = static_cast<int>(tasks.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int i = 0; i < num_tasks; ++i) {
        const Task& tk = tasks[i];
        const int64_t b = rows[2 * tk.row], tok = rows[2 * tk.row + 1];
        alignas(64) float own[MAX_GROUP * (MAX_D + 2)];
        float* base = tk.slot < 0 ? own : partial.data() + static_cast<size_t>(tk.slot) * per_slot;
        if (tree_start && tree_start[tk.row] < tk.last)  // the chunk holds keys of the row's tree: masked
            chunk_dispatch<T, true>(q + tok * q_stride, k_cache, v_cache, block_tables + b * bt_stride, block_size,
                                    Hkv, group, D, tk.kvh, tk.first, tk.last, scale, base, base + group,
                                    base + 2 * group, tree_start[tk.row], tree_bits[tk.row]);
        else
            chunk_dispatch<T, false>(q + tok * q_stride, k_cache, v_cache, block_tables + b * bt_stride, block_size,
                                     Hkv, group, D, tk.kvh, tk.first, tk.last, scale, base, base + group,
                                     base + 2 * group, 0, 0);
        if (tk.slot < 0) {  // the whole row: normalise into out
            T* o = out + tok * out_stride + tk.kvh * group * D;
            for (int g = 0; g < group; ++g) {
                const float inv = 1.f / base[group + g];
                const float* acc = base + 2 * group + g * D;
                for (int d = 0; d < D; ++d) store(o, g * D + d, acc[d] * inv);
            }
        }
    }
    // combine the chunks of each (row, KV head): rescale to the largest max, then normalise
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_slots > 0)
    for (int i = 0; i < num_rows * Hkv; ++i) {
        const int r = i / Hkv, h = i % Hkv;
        const int chunks = (row_slot[r + 1] - row_slot[r]) / Hkv;
        if (chunks == 0) continue;  // finished by its task
        const float* first = partial.data() + static_cast<size_t>(row_slot[r] + h * chunks) * per_slot;
        T* o = out + rows[2 * r + 1] * out_stride + h * group * D;
        for (int g = 0; g < group; ++g) {
            float mx = first[g];
            for (int c = 1; c < chunks; ++c) mx = std::max(mx, first[c * per_slot + g]);
            float a[MAX_D];
            for (int d = 0; d < D; ++d) a[d] = 0.f;
            float sum = 0.f;
            for (int c = 0; c < chunks; ++c) {
                const float* p = first + c * per_slot;
                const float w = std::exp(p[g] - mx);
                sum += p[group + g] * w;
                const float* acc = p + 2 * group + g * D;
                for (int d = 0; d < D; ++d) a[d] += acc[d] * w;
            }
            const float inv = 1.f / sum;
            for (int d = 0; d < D; ++d) store(o, g * D + d, a[d] * inv);
        }
    }
    return 0;
}

}  // namespace

extern "C" {

// dtype: 0 float32, 1 bfloat16 (q, out and the caches share it; the arithmetic is float32).
// rows: [num_rows, 2] int64, (sequence index into block_tables/context_lens, token index into q/out).
// num_tokens, num_seqs: rows of q and of block_tables; max_blocks: columns of block_tables;
// num_blocks: blocks in each cache. Returns 0, or a nonzero code for arguments the kernel
// does not take (checked before anything is read): 1 shape, 2 empty row, 4 row index,
// 5 block table, 6 a row whose tree mask hides all its keys.
// tree_start [num_rows] int32 and tree_bits [num_rows] (64-bit sets), both or neither (null):
// row r then reads key j only if j < tree_start[r] or bit j - tree_start[r] of tree_bits[r] is set.
int minillm_attention_rows_tree(int dtype, const void* q, int64_t q_stride, void* out, int64_t out_stride,
                                const void* k_cache, const void* v_cache, int block_size, int num_kv_heads,
                                int group, int head_dim, const int32_t* block_tables, int64_t bt_stride,
                                const int32_t* context_lens, const int64_t* rows, int num_rows, float scale,
                                int num_threads, int64_t num_tokens, int64_t num_seqs, int64_t max_blocks,
                                int64_t num_blocks, const int32_t* tree_start, const uint64_t* tree_bits) {
    const Shape shape{num_tokens, num_seqs, max_blocks, num_blocks};
    if (!tree_start != !tree_bits) return 1;
    if (dtype == 0)
        return run(static_cast<const float*>(q), q_stride, static_cast<float*>(out), out_stride,
                   static_cast<const float*>(k_cache), static_cast<const float*>(v_cache), block_size, num_kv_heads,
                   group, head_dim, block_tables, bt_stride, context_lens, rows, num_rows, scale, num_threads, shape,
                   tree_start, tree_bits);
    if (dtype == 1)
        return run(static_cast<const bf16*>(q), q_stride, static_cast<bf16*>(out), out_stride,
                   static_cast<const bf16*>(k_cache), static_cast<const bf16*>(v_cache), block_size, num_kv_heads,
                   group, head_dim, block_tables, bt_stride, context_lens, rows, num_rows, scale, num_threads, shape,
                   tree_start, tree_bits);
    return 3;
}

// The same without tree masks (the arguments build.py declares).
int minillm_attention_rows(int dtype, const void* q, int64_t q_stride, void* out, int64_t out_stride,
                           const void* k_cache, const void* v_cache, int block_size, int num_kv_heads,
                           int group, int head_dim, const int32_t* block_tables, int64_t bt_stride,
                           const int32_t* context_lens, const int64_t* rows, int num_rows, float scale,
                           int num_threads, int64_t num_tokens, int64_t num_seqs, int64_t max_blocks,
                           int64_t num_blocks) {
    return minillm_attention_rows_tree(dtype, q, q_stride, out, out_stride, k_cache, v_cache, block_size,
                                       num_kv_heads, group, head_dim, block_tables, bt_stride, context_lens, rows,
                                       num_rows, scale, num_threads, num_tokens, num_seqs, max_blocks, num_blocks,
                                       nullptr, nullptr);
}

}
