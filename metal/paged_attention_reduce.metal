// Paged attention, pass 2 of 2 (Metal body; twin of paged_attention_reduce.cu).
//
// One threadgroup per (query row, head), one thread per element of the head dimension: merge
// the partitions' softmax states (max, sum, unnormalised output) into the normalised output.
// Template constants: T (output element type), HEAD_DIM.

const size_t row_head = threadgroup_position_in_grid.x;
const int d = int(thread_position_in_threadgroup.x);
const int parts = part_max_shape[2];
const size_t first = row_head * parts;

float mx_all = -1e30f;
for (int p = 0; p < parts; ++p) {
  mx_all = metal::max(mx_all, part_max[first + p]);
}
float sum = 0.0f;
float acc = 0.0f;
for (int p = 0; p < parts; ++p) {
  const float f = metal::exp(part_max[first + p] - mx_all);
  sum += part_sum[first + p] * f;
  acc += part_acc[(first + p) * HEAD_DIM + d] * f;
}
out[row_head * HEAD_DIM + d] = static_cast<T>(acc / sum);
