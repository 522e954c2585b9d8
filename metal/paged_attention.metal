// Metal body for mx.fast.metal_kernel, generated from paged_attention.kernel by
// `python -m edgeserve.metal.codegen`: edit the template, not this file.
//
// Paged attention, pass 1 of 2.
//
// One threadgroup (CUDA: thread block) per (query row, KV head, partition of the row's visible
// context). The row attends to tokens [0, row_len) of its sequence, read from the pool through
// its block table; a decode row sees its whole context, a prefill row sees the tokens up to its
// own position. The threadgroup's 4 SIMD groups (warps) walk the partition's tokens: a SIMD
// group holds SLOTS tokens at a time, each in a group of LANES lanes that own VEC elements of
// the head dimension apiece. Every lane group keeps an online softmax (running max, running
// sum, unnormalised output) for all GROUP query heads that share the KV head, so each K/V row
// is read once for the whole group. The states are merged within the SIMD group by shuffles,
// then across SIMD groups in threadgroup (shared) memory, and the partition's (max, sum,
// output) goes to pass 2, which merges the partitions.
//
// Template constants: T (element type of q, and of the pool unless it is int8), HEAD_DIM, GROUP
// (query heads per KV head), N_KV (KV heads), BLOCK_SIZE (tokens per pool block), PART (tokens
// per partition), KV_SCALES (0, or for an int8 pool the float16 scales of a head: its HEAD_DIM
// int8 values come first, then a scale per HEAD_DIM / KV_SCALES of them, as kv_formats lays it
// out; the values are dequantized in registers).
// Everything stays in this body, and buffers are indexed by offsets rather than pointers,
// because Metal binds small inputs in the constant address space.

constexpr int WARPS = 4;
constexpr int VEC = 8;
constexpr int LANES = HEAD_DIM / VEC;
constexpr int SLOTS = 32 / LANES;
constexpr float MASKED = -1e30f;
constexpr int ROW = HEAD_DIM + 2 * KV_SCALES;  // elements of one pool head

const int row = int(threadgroup_position_in_grid.x);
const int kv_head = int(threadgroup_position_in_grid.y);
const int part = int(threadgroup_position_in_grid.z);
const int num_parts = int(threadgroups_per_grid.z);
const int warp = int(simdgroup_index_in_threadgroup);
const int lane = int(thread_index_in_simdgroup);
const int slot = lane / LANES;
const int dim0 = (lane % LANES) * VEC;

const int len = row_len[row];
const int begin = part * PART;
const int end = min(begin + PART, len);
const int table = row_seq[row] * block_tables_shape[1];
const float scale = metal::rsqrt(float(HEAD_DIM));

float qf[GROUP][VEC];
float acc[GROUP][VEC];
float m[GROUP];
float l[GROUP];
for (int g = 0; g < GROUP; ++g) {
  const size_t q0 = (size_t(row) * N_KV * GROUP + kv_head * GROUP + g) * HEAD_DIM + dim0;
  for (int e = 0; e < VEC; ++e) {
    qf[g][e] = float(q[q0 + e]);
  }
  for (int e = 0; e < VEC; ++e) {
    qf[g][e] *= scale;
    acc[g][e] = 0.0f;
  }
  m[g] = MASKED;
  l[g] = 0.0f;
}

// The loop bound is the same for the whole SIMD group, so every lane reaches every shuffle.
for (int t0 = begin + warp * SLOTS; t0 < end; t0 += WARPS * SLOTS) {
  const int t = t0 + slot;
  const bool valid = t < end;
  float kf[VEC];
  float vf[VEC];
  for (int e = 0; e < VEC; ++e) {
    kf[e] = 0.0f;
  }
  if (valid) {
    const int block = block_tables[table + t / BLOCK_SIZE];
    const size_t head = ((size_t(block) * BLOCK_SIZE + t % BLOCK_SIZE) * N_KV + kv_head) * ROW;
    if (KV_SCALES > 0) {
      // An int8 head of HEAD_DIM + 2 * KV_SCALES bytes starts only 2-byte aligned, so its values
      // are read one by one; a lane's VEC values lie in one scale's group.
      const size_t scale_at = head + HEAD_DIM + 2 * (dim0 * KV_SCALES / HEAD_DIM);
      const float k_scale = float(*reinterpret_cast<const device half*>(k_cache + scale_at));
      const float v_scale = float(*reinterpret_cast<const device half*>(v_cache + scale_at));
      for (int e = 0; e < VEC; ++e) {
        kf[e] = float(k_cache[head + dim0 + e]) * k_scale;
        vf[e] = float(v_cache[head + dim0 + e]) * v_scale;
      }
    } else {
      for (int e = 0; e < VEC; ++e) {
        kf[e] = float(k_cache[head + dim0 + e]);
      }
      for (int e = 0; e < VEC; ++e) {
        vf[e] = float(v_cache[head + dim0 + e]);
      }
    }
  }
  float s[GROUP];
  for (int g = 0; g < GROUP; ++g) {
    float dot = 0.0f;
    for (int e = 0; e < VEC; ++e) {
      dot += qf[g][e] * kf[e];
    }
    for (int o = LANES / 2; o > 0; o /= 2) {
      dot += simd_shuffle_xor(dot, ushort(o));
    }
    s[g] = dot;
  }
  if (valid) {
    for (int g = 0; g < GROUP; ++g) {
      const float m_new = metal::max(m[g], s[g]);
      const float keep = metal::exp(m[g] - m_new);
      const float p = metal::exp(s[g] - m_new);
      l[g] = l[g] * keep + p;
      for (int e = 0; e < VEC; ++e) {
        acc[g][e] = acc[g][e] * keep + p * vf[e];
      }
      m[g] = m_new;
    }
  }
}

// Merge the SIMD group's lane groups: lanes that own the same dimensions, SLOTS apart.
for (int o = LANES; o < 32; o *= 2) {
  for (int g = 0; g < GROUP; ++g) {
    const float m_other = simd_shuffle_xor(m[g], ushort(o));
    const float l_other = simd_shuffle_xor(l[g], ushort(o));
    const float m_new = metal::max(m[g], m_other);
    const float keep = metal::exp(m[g] - m_new);
    const float take = metal::exp(m_other - m_new);
    l[g] = l[g] * keep + l_other * take;
    for (int e = 0; e < VEC; ++e) {
      const float a_other = simd_shuffle_xor(acc[g][e], ushort(o));
      acc[g][e] = acc[g][e] * keep + a_other * take;
    }
    m[g] = m_new;
  }
}

threadgroup float warp_max[WARPS][GROUP];
threadgroup float warp_sum[WARPS][GROUP];
threadgroup float warp_acc[WARPS][GROUP][HEAD_DIM];
if (slot == 0) {
  for (int g = 0; g < GROUP; ++g) {
    for (int e = 0; e < VEC; ++e) {
      warp_acc[warp][g][dim0 + e] = acc[g][e];
    }
    if (lane == 0) {
      warp_max[warp][g] = m[g];
      warp_sum[warp][g] = l[g];
    }
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);

for (int i = int(thread_index_in_threadgroup); i < GROUP * HEAD_DIM; i += WARPS * 32) {
  const int g = i / HEAD_DIM;
  const int d = i % HEAD_DIM;
  float mx_all = MASKED;
  for (int w = 0; w < WARPS; ++w) {
    mx_all = metal::max(mx_all, warp_max[w][g]);
  }
  float sum = 0.0f;
  float out = 0.0f;
  for (int w = 0; w < WARPS; ++w) {
    const float f = metal::exp(warp_max[w][g] - mx_all);
    sum += warp_sum[w][g] * f;
    out += warp_acc[w][g][d] * f;
  }
  const size_t o = (size_t(row) * N_KV * GROUP + kv_head * GROUP + g) * num_parts + part;
  part_acc[o * HEAD_DIM + d] = out;
  if (d == 0) {
    part_max[o] = mx_all;
    part_sum[o] = sum;
  }
}
