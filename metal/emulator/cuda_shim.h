// Just enough of CUDA for C++20 to compile a kernel as mx.fast.cuda_kernel writes it (less its
// header, which this replaces), and to run it with lockstep.h: a warp is a SIMD group.
#pragma once

#include <array>

#include "lockstep.h"

namespace emu {

template <typename T>
Shuffle<T> shfl_xor_sync(unsigned members, T value, unsigned mask, int line) {
  if (members != 0xffffffffu) {
    fail("shuffles with a partial member mask, which is not emulated", 0, int(current->where.thread_index_in_threadgroup),
         line, line);
  }
  return {value, mask, line};
}

}  // namespace emu

namespace cooperative_groups {}

constexpr int MAX_NDIM = 10;
using Shape = std::array<int32_t, MAX_NDIM>;
using Strides = std::array<int64_t, MAX_NDIM>;
typedef _Float16 __half;
typedef emu::bfloat16 __nv_bfloat16;

inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline int min(int a, int b) { return a < b ? a : b; }

#define __global__
#define __grid_constant__
#define __shared__ EMU_THREADGROUP
#define __syncthreads() co_await emu::Barrier{__LINE__}
#define __shfl_xor_sync(members, value, mask) (co_await emu::shfl_xor_sync((members), (value), (mask), __LINE__))
#define threadIdx (emu::current->where.thread_position_in_threadgroup)
#define blockIdx (emu::current->where.threadgroup_position_in_grid)
#define blockDim (emu::current->where.threads_per_threadgroup)
#define gridDim (emu::current->where.threadgroups_per_grid)
