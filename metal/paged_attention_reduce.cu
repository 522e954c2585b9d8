// Paged attention, pass 2 of 2 (CUDA body; twin of paged_attention_reduce.metal).
//
// One thread block per (query row, head), one thread per element of the head dimension: merge
// the partitions' softmax states (max, sum, unnormalised output) into the normalised output.
// Template constants: T (output element type), HEAD_DIM.

const size_t row_head = blockIdx.x;
const int d = threadIdx.x;
const int parts = part_max_shape[2];
const float* maxes = part_max + row_head * parts;
const float* sums = part_sum + row_head * parts;
const float* accs = part_acc + row_head * parts * HEAD_DIM;

float mx_all = -1e30f;
for (int p = 0; p < parts; ++p) {
  mx_all = fmaxf(mx_all, maxes[p]);
}
float sum = 0.0f;
float acc = 0.0f;
for (int p = 0; p < parts; ++p) {
  const float f = expf(maxes[p] - mx_all);
  sum += sums[p] * f;
  acc += accs[p * HEAD_DIM + d] * f;
}
out[row_head * HEAD_DIM + d] = static_cast<T>(acc / sum);
