// CUDA body for mx.fast.cuda_kernel, generated from paged_attention_reduce.kernel by
// `python -m edgeserve.metal.codegen`: edit the template, not this file.
//
// Paged attention, pass 2 of 2.
//
// One threadgroup (CUDA: thread block) per (query row, head), one thread per element of the
// head dimension: merge the partitions' softmax states (max, sum, unnormalised output) into the
// normalised output. Template constants: T (output element type), HEAD_DIM.

const int row_head = int(blockIdx.x);
const int d = int(threadIdx.x);
const int parts = part_max_shape[2];
const size_t first = size_t(row_head) * parts;

float mx_all = -1e30f;
for (int p = 0; p < parts; ++p) {
  mx_all = fmaxf(mx_all, part_max[first + p]);
}
float sum = 0.0f;
float acc = 0.0f;
for (int p = 0; p < parts; ++p) {
  const float f = expf(part_max[first + p] - mx_all);
  sum += part_sum[first + p] * f;
  acc += part_acc[(first + p) * HEAD_DIM + d] * f;
}
out[size_t(row_head) * HEAD_DIM + d] = static_cast<T>(acc / sum);
