// CUDA body for mx.fast.cuda_kernel: one layer's K and V rows of a step, written into the pool in place.
//
// MLX's own scatter updates the pool's buffer in place only while nothing in flight still reads
// it, and the engine launches a decode step while the one before still computes: a scatter would
// then copy the whole pool, for every layer of every step. This kernel writes through the pool
// inputs' pointers instead, so MLX never sees the pool change: the attention that reads these rows
// takes `written` as an input, and MLX's CUDA graphs order their kernels by the buffers they share,
// so it runs after this kernel. Work queued before this one (the step before) runs before it: one
// stream.
//
// One thread per element of a row's heads: rows [rows, N_KV, ROW] of k and v (strided as they
// come) to pool slot slots[row], the pool laid out [slot, N_KV, ROW]. Template constant: T, the
// pool's element type (k and v come in it).

const int64_t per_row = int64_t(k_shape[1]) * k_shape[2];
const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
if (i == 0) {
  written[0] = 1;
}
if (i < int64_t(slots_shape[0]) * per_row) {
  const int64_t row = i / per_row;
  const int64_t head = (i % per_row) / k_shape[2];
  const int64_t e = i % k_shape[2];
  const int64_t to = int64_t(slots[row]) * per_row + i % per_row;
  const_cast<T*>(k_pool)[to] = k[row * k_strides[0] + head * k_strides[1] + e * k_strides[2]];
  const_cast<T*>(v_pool)[to] = v[row * v_strides[0] + head * v_strides[1] + e * v_strides[2]];
}
