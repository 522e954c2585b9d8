// Just enough of the Metal Shading Language for C++20 to compile a kernel as
// mx.fast.metal_kernel writes it, and to run it with lockstep.h.
#pragma once

#include "lockstep.h"

namespace metal {

template <typename T>
T max(T a, T b) {
  return a > b ? a : b;
}
template <typename T>
T min(T a, T b) {
  return a < b ? a : b;
}
inline float exp(float x) { return std::exp(x); }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }

enum class mem_flags { mem_none, mem_device, mem_threadgroup };

}  // namespace metal

namespace emu {

inline Barrier barrier(metal::mem_flags, int line) { return {line}; }

}  // namespace emu

using namespace metal;
using uint = uint32_t;
using ushort = unsigned short;
using uint3 = emu::uint3;
typedef _Float16 half;
typedef half float16_t;
typedef emu::bfloat16 bfloat;
typedef bfloat bfloat16_t;

#define simd_shuffle_xor(value, mask) (co_await emu::shuffle_xor((value), (mask), __LINE__))
#define threadgroup_barrier(flags) co_await emu::barrier((flags), __LINE__)
// Address spaces. A constant buffer is volatile here so that, as in Metal, it cannot go where a
// device pointer is expected; threadgroup variables are statics shared by the coroutines.
#define device
#define constant volatile
#define threadgroup EMU_THREADGROUP
