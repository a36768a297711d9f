// float32 and bfloat16 elements as the CPU kernels read and write them (attention_rows.cpp,
// layer_ops.cpp): the arithmetic is float32; a bfloat16 is the top half of a float32.
#pragma once
#include <cstdint>
#include <cstring>

namespace minillm {

typedef uint16_t bf16;

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const bf16* p, int64_t i) {
    uint32_t u = static_cast<uint32_t>(p[i]) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// x rounded to the element type, as a float: float32 is x itself; bfloat16 is the nearest one
// (even on ties), as torch's .to(bfloat16) and its bfloat16 arithmetic round. A NaN stays a NaN.
inline float round_to(float, float x) { return x; }
inline float round_to(bf16, float x) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    u = (u & 0x7fffffffu) > 0x7f800000u ? (u | 0x00400000u) & 0xffff0000u : rounded;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// Stores x rounded to the element type.
inline void store(float* p, int64_t i, float x) { p[i] = x; }
inline void store(bf16* p, int64_t i, float x) {
    const float r = round_to(bf16(), x);
    uint32_t u;
    std::memcpy(&u, &r, 4);
    p[i] = static_cast<bf16>(u >> 16);
}

}  // namespace minillm
