/* What the C files of the _qmatmul extension share: its thread pool (_pool.h), the instruction set
   chosen at run time, and the entry points of the fused CPU ops (_cpu_ops.c) and of the sampler's ops (_logits.c) listed in
   the module. */
#ifndef EDGESERVE_QMATMUL_H
#define EDGESERVE_QMATMUL_H

#include "_pool.h"

#include <stdint.h>

#if defined(__x86_64__) || defined(__i386__)
#define QM_X86 1
#include <immintrin.h>
#endif

/* The code path chosen (by CPU features or set_isa): 2 AVX-512, 1 AVX2, 0 portable C. */
int qm_isa_level(void);

/* A packed weight matrix [N, K] as qmatmul.prepare lays it out (see _qmatmul.c). */
typedef struct {
    const uint32_t *w;
    const void *scales, *biases;  /* float16 or float32; d and dmin for K-quants */
    const uint32_t *hw;           /* K-quants' high-bit plane, or NULL */
    const int8_t *ksc, *km;       /* K-quants' int8 group scales and mins, or NULL */
    float center;                 /* biases NULL: a group's bias is -center * its scale (Q4_0, Q5_0, Q8_0);
                                     a power of two */
    int N, K, bits, group, f16, kq, hbits;
} QmMatrix;

/* Fills m from gemm's weight arguments (7 or 11 objects), holding their buffers in held from
   index *nheld on (6 at most); -1 with a Python error set when they do not fit together. */
int qm_matrix_parse(PyObject *const *args, int n, Py_ssize_t K, QmMatrix *m, Py_buffer *held, int *nheld);

/* The C-level ops behind the Python entry points, for callers that chain them (_decoder.c); each
   runs on the pool, with qm_call_lock held. Rows are `*_row` floats apart. */

/* out[:, :N] = x @ W.T for x [R, K] C-contiguous; -1 when out of memory. */
int qm_gemm(const QmMatrix *m, const float *x, int R, float *out, Py_ssize_t ldo);

/* The widest head attention takes. */
#define QM_MAX_HEAD_DIM 256

/* A KV pool's element type. A pool is [blocks, bs, n_kv, head] with a head of hd float32 or float16
   values, or (int8) hd int8 values followed by the float16 scales, max|x| / 127, of each 64 of them
   (of all hd where hd is not a multiple of 64): a block carries its own scales, so whatever moves
   blocks moves them too. */
enum { QM_KV_F32 = 0, QM_KV_F16 = 1, QM_KV_I8 = 2 };

/* The type of a 4-D pool buffer for heads of hd values, or -1 when it is none of them (float16 and
   int8 need a compiler with _Float16). */
int qm_kv_type(const Py_buffer *b, Py_ssize_t hd);

/* The names of the types this build reads and writes ("float32", "float16", "int8"), a tuple. */
PyObject *qm_kv_type_names(void);

/* Bytes of one head of hd values in a pool of the type. */
size_t qm_kv_head_bytes(int kv_type, int hd);

/* Attention of D query rows q [D, H, hd] over the pools of kv_type [blocks, bs, n_kv, head], row s
   seeing lens[s] keys through block_tables row s (its last `window` of them where window > 0); out
   [D, H, hd] C-contiguous. -1 when out of memory. */
int qm_attention(const float *q, Py_ssize_t q_row, const void *k, const void *v, int kv_type, int bs, int n_kv,
                 const int64_t *block_tables, Py_ssize_t bt_row, const int64_t *lens, int D, int H, int hd,
                 float scale, int window, float *out);

/* Whether a buffer holds float32 / int64 / uint32 elements. */
int qm_is_f32(const Py_buffer *b);
int qm_is_i64(const Py_buffer *b);
int qm_is_u32(const Py_buffer *b);

/* The first row whose length or block ids fall outside a pool of `blocks` blocks of bs keys, or -1. */
int qm_bad_table_row(const int64_t *block_tables, Py_ssize_t bt_row, Py_ssize_t bt_cols, const int64_t *lens, int D,
                     int bs, Py_ssize_t blocks);

/* Rows `slots` of a KV pool of kv_type (rows of n_kv heads of hd values) = values float32, rows
   `values_row` floats apart, converted to the pool's type; slots checked by the caller. */
void qm_write_kv(void *cache, int kv_type, const float *values, Py_ssize_t values_row, const int64_t *slots, int rows,
                 int n_kv, int hd);

void qm_rms_norm(const float *x, Py_ssize_t x_row, const float *w, float *out, Py_ssize_t out_row, int rows, int cols,
                 float eps);

/* Heads x [rows, heads, hd] (heads contiguous) into out [rows, heads, hd] C-contiguous; cos, sin [rows, hd / 2]. */
void qm_rope(const float *x, Py_ssize_t x_row, const float *cos, const float *sin, float *out, int rows, int heads,
             int hd);

/* silu(gate) * up for x = gate | up [rows, 2 * cols] into out [rows, cols]. */
void qm_silu_mul(const float *x, Py_ssize_t x_row, float *out, Py_ssize_t out_row, int rows, int cols);

/* gelu(gate) * up, GELU in its tanh approximation, for x = gate | up [rows, 2 * cols] into out [rows, cols]. */
void qm_gelu_tanh_mul(const float *x, Py_ssize_t x_row, float *out, Py_ssize_t out_row, int rows, int cols);

/* RMSNorm over each of the `heads` heads [hd] of x's rows (heads contiguous), in place: Qwen 3's
   and Gemma 3's q and k norms, the same bits as qm_rms_norm on the heads as rows. */
void qm_head_rms_norm(float *x, Py_ssize_t x_row, const float *w, int rows, int heads, int hd, float eps);

/* The most top entries logit_stats keeps a row, and sample_logits' top-k and top-p look at; logits at or below
   -QM_LOGIT_LIMIT are masked (a grammar's). */
#define QM_MAX_TOP 256
#define QM_LOGIT_LIMIT 1e30f

/* Rows rows[0..R) of logits x [*, V] (rows `row` floats apart): norm[i] = each row's log-sum-exp (NaN where its
   max is not finite) and top[i * k ..] its k largest entries' ids, largest first, of equal ones the lower id. */
void qm_logit_stats(const float *x, Py_ssize_t row, const int64_t *rows, int R, int V, int k, double *norm,
                    int64_t *top);

/* token[i] = a token drawn from softmax(x[rows[i]] * inv_t[i]), cut to its top_k[i] (0: all), its weights at
   least min_p[i] of the largest and its likeliest reaching top_p[i], by the uniform u[i]; -1 where the row's max is
   not finite or is masked, or its cuts need more than QM_MAX_TOP of its likeliest. */
void qm_sample_logits(const float *x, Py_ssize_t row, const int64_t *rows, int R, int V, const float *inv_t,
                      const int32_t *top_k, const float *top_p, const float *min_p, const double *u, int64_t *token);

PyObject *qm_py_attention(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *qm_py_rms_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *qm_py_rope(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *qm_py_silu_mul(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *qm_py_logit_stats(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *qm_py_sample_logits(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *qm_py_write_kv(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *qm_py_decoder_plan(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *qm_py_decoder_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

#endif
