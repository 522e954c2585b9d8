/* Rows of logits for the engine's sampler (engine/sampler.py): each row's log-normalizer and top k
entries (logprobs), and a token drawn from a row at a temperature.

A row of a 49,152-token vocabulary took NumPy a third of a millisecond to sample (float64 copies, a
cumulative sum) and more for its top 20 (a partition): a step of 16 sampled answers with logprobs
spent as long in them as in the model. Here a row is one item on the pool and two or three passes:
its max; then the sum of its exponentials, in float32 (exp_poly) summed in float64 as NumPy's path
does; then the draw, which adds them up again until it passes u times the sum. The top k go along
with the max: a chunk of LG_CHUNK logits is looked at one by one only where its max beats the k-th
best so far, which after the first few chunks is almost never.

An exponential below exp's range is zero, as in NumPy (a grammar's masked logit, -1e30, never comes
up), and so is a NaN logit's. Rows whose max is not finite (inf) or is masked are left to the caller. Code paths:
AVX-512, AVX2 and portable C for the passes; the draw's last step and the top k are scalar. */
#include "_qmatmul.h"
#include "_vmath.h"

#include <math.h>

#define LG_CHUNK 64
#define EXP_FLOOR -87.3f /* exp_poly's lower clamp: below it an exponential is zero */

typedef struct {
    const float *x;
    Py_ssize_t row; /* floats between rows */
    const int64_t *rows;
    int V, k;
    double *norm;              /* logit_stats: log-normalizers */
    int64_t *top;              /* and each row's top k, k apart */
    const float *inv_t;        /* sample: 1 / temperature, */
    const double *u;           /* a uniform draw in [0, 1), */
    int64_t *token;            /* and the token drawn (-1: left to the caller) */
} LogitTask;

/* ---- the passes, by code path ---- */

static float max_generic(const float *x, int n) {
    float m = -INFINITY;
    for (int i = 0; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

static inline __attribute__((always_inline)) float exp_term(float x, float m, float s) {
    const float a = (x - m) * s;
    return a >= EXP_FLOOR ? exp_poly(a) : 0.f; /* NaN too: no weight */
}

static double expsum_generic(const float *x, int n, float m, float s) {
    double total = 0.0;
    for (int i = 0; i < n; i++) total += exp_term(x[i], m, s);
    return total;
}

/* The first i with cum + e_0 + ... + e_i > target, cum updated; -1 where the row's end comes first. */
static int draw_generic(const float *x, int n, float m, float s, double target, double *cum) {
    for (int i = 0; i < n; i++) {
        *cum += exp_term(x[i], m, s);
        if (*cum > target) return i;
    }
    return -1;
}

#ifdef QM_X86
#define LG_AVX2 __attribute__((target("avx2,fma")))
#define LG_AVX512 __attribute__((target("avx512f")))

static LG_AVX512 float max_avx512(const float *x, int n) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    int i = 0;
    for (; i + 16 <= n; i += 16) m = _mm512_max_ps(_mm512_loadu_ps(x + i), m);
    const float head = _mm512_reduce_max_ps(m), tail = max_generic(x + i, n - i);
    return tail > head ? tail : head;
}

static inline LG_AVX512 __attribute__((always_inline)) __m512 exp_terms512(__m512 x, __m512 m, __m512 s) {
    const __m512 a = _mm512_mul_ps(_mm512_sub_ps(x, m), s);
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(EXP_FLOOR), _CMP_GE_OQ), exp512(a));
}

static inline LG_AVX512 __attribute__((always_inline)) __m512d low_pd(__m512 e) {
    return _mm512_cvtps_pd(_mm512_castps512_ps256(e));
}

static inline LG_AVX512 __attribute__((always_inline)) __m512d high_pd(__m512 e) {
    return _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
}

static LG_AVX512 double expsum_avx512(const float *x, int n, float m, float s) {
    const __m512 mv = _mm512_set1_ps(m), sv = _mm512_set1_ps(s);
    __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 e = exp_terms512(_mm512_loadu_ps(x + i), mv, sv);
        lo = _mm512_add_pd(lo, low_pd(e));
        hi = _mm512_add_pd(hi, high_pd(e));
    }
    return _mm512_reduce_add_pd(_mm512_add_pd(lo, hi)) + expsum_generic(x + i, n - i, m, s);
}

static LG_AVX512 int draw_avx512(const float *x, int n, float m, float s, double target, double *cum) {
    const __m512 mv = _mm512_set1_ps(m), sv = _mm512_set1_ps(s);
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 e = exp_terms512(_mm512_loadu_ps(x + i), mv, sv);
        const double sum = _mm512_reduce_add_pd(_mm512_add_pd(low_pd(e), high_pd(e)));
        if (*cum + sum > target) { /* the token is in these 16 (or, by rounding, just after) */
            float terms[16];
            _mm512_storeu_ps(terms, e);
            for (int j = 0; j < 16; j++) {
                *cum += terms[j];
                if (*cum > target) return i + j;
            }
        } else {
            *cum += sum;
        }
    }
    const int j = draw_generic(x + i, n - i, m, s, target, cum);
    return j < 0 ? -1 : i + j;
}

static LG_AVX2 float max_avx2(const float *x, int n) {
    __m256 m = _mm256_set1_ps(-INFINITY);
    int i = 0;
    for (; i + 8 <= n; i += 8) m = _mm256_max_ps(_mm256_loadu_ps(x + i), m);
    float lanes[8];
    _mm256_storeu_ps(lanes, m);
    float head = max_generic(lanes, 8), tail = max_generic(x + i, n - i);
    return tail > head ? tail : head;
}

static inline LG_AVX2 __attribute__((always_inline)) __m256 exp_terms256(__m256 x, __m256 m, __m256 s) {
    const __m256 a = _mm256_mul_ps(_mm256_sub_ps(x, m), s);
    return _mm256_and_ps(_mm256_cmp_ps(a, _mm256_set1_ps(EXP_FLOOR), _CMP_GE_OQ), exp256(a));
}

static inline LG_AVX2 __attribute__((always_inline)) __m256d sum_pd(__m256 e) {
    return _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(e)), _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
}

static inline LG_AVX2 __attribute__((always_inline)) double reduce_pd(__m256d v) {
    double lanes[4];
    _mm256_storeu_pd(lanes, v);
    return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
}

static LG_AVX2 double expsum_avx2(const float *x, int n, float m, float s) {
    const __m256 mv = _mm256_set1_ps(m), sv = _mm256_set1_ps(s);
    __m256d acc = _mm256_setzero_pd();
    int i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_add_pd(acc, sum_pd(exp_terms256(_mm256_loadu_ps(x + i), mv, sv)));
    return reduce_pd(acc) + expsum_generic(x + i, n - i, m, s);
}

static LG_AVX2 int draw_avx2(const float *x, int n, float m, float s, double target, double *cum) {
    const __m256 mv = _mm256_set1_ps(m), sv = _mm256_set1_ps(s);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp_terms256(_mm256_loadu_ps(x + i), mv, sv);
        const double sum = reduce_pd(sum_pd(e));
        if (*cum + sum > target) {
            float terms[8];
            _mm256_storeu_ps(terms, e);
            for (int j = 0; j < 8; j++) {
                *cum += terms[j];
                if (*cum > target) return i + j;
            }
        } else {
            *cum += sum;
        }
    }
    const int j = draw_generic(x + i, n - i, m, s, target, cum);
    return j < 0 ? -1 : i + j;
}
#endif

typedef struct {
    float (*max)(const float *, int);
    double (*expsum)(const float *, int, float, float);
    int (*draw)(const float *, int, float, float, double, double *);
} Passes;

static Passes passes(void) {
#ifdef QM_X86
    if (qm_isa_level() == 2) return (Passes){max_avx512, expsum_avx512, draw_avx512};
    if (qm_isa_level() == 1) return (Passes){max_avx2, expsum_avx2, draw_avx2};
#endif
    return (Passes){max_generic, expsum_generic, draw_generic};
}

/* ---- the items ---- */

/* Entry j (value v) into the k best so far (vals, ids descending, n of them): after any equal value, so that of
   equal logits the lower id comes first (entries arrive in id order). */
static void keep_best(float *vals, int64_t *ids, int *n, int k, float v, int64_t j) {
    int at = *n < k ? *n : k - 1;
    if (*n == k && !(v > vals[k - 1])) return;
    while (at > 0 && v > vals[at - 1]) {
        vals[at] = vals[at - 1];
        ids[at] = ids[at - 1];
        at--;
    }
    vals[at] = v;
    ids[at] = j;
    if (*n < k) (*n)++;
}

static void stats_item(const void *ctx, int i) {
    const LogitTask *t = (const LogitTask *)ctx;
    const Passes p = passes();
    const float *x = t->x + (size_t)t->rows[i] * t->row;
    float vals[QM_MAX_TOP];
    int64_t *ids = t->top + (size_t)i * t->k;
    int n = 0;
    float m = t->k ? -INFINITY : p.max(x, t->V);
    for (int c = 0; t->k && c < t->V; c += LG_CHUNK) {
        const int len = t->V - c < LG_CHUNK ? t->V - c : LG_CHUNK;
        const float cm = p.max(x + c, len);
        m = cm > m ? cm : m;
        if (n == t->k && !(cm > vals[t->k - 1])) continue;
        for (int j = c; j < c + len; j++)
            if (x[j] == x[j]) keep_best(vals, ids, &n, t->k, x[j], j); /* NaN: never among the best */
    }
    t->norm[i] = isfinite(m) ? m + log(p.expsum(x, t->V, m, 1.f)) : NAN;
}

static void sample_item(const void *ctx, int i) {
    const LogitTask *t = (const LogitTask *)ctx;
    const Passes p = passes();
    const float *x = t->x + (size_t)t->rows[i] * t->row;
    const float m = p.max(x, t->V), s = t->inv_t[i];
    t->token[i] = -1;
    if (!isfinite(m) || m <= -QM_LOGIT_LIMIT) return;
    const double total = p.expsum(x, t->V, m, s);
    if (!(total > 0.0) || !isfinite(total)) return;
    double cum = 0.0;
    int token = p.draw(x, t->V, m, s, t->u[i] * total, &cum);
    /* past the end only by rounding (the draw's sums are in another order than the total's): the last token with
       a weight */
    for (int j = t->V - 1; token < 0 && j >= 0; j--)
        if ((x[j] - m) * s >= EXP_FLOOR) token = j;
    t->token[i] = token;
}

void qm_logit_stats(const float *x, Py_ssize_t row, const int64_t *rows, int R, int V, int k, double *norm,
                    int64_t *top) {
    LogitTask t = {.x = x, .row = row, .rows = rows, .V = V, .k = k, .norm = norm, .top = top};
    if (R > 0) qm_parallel(R, stats_item, &t);
}

void qm_sample_logits(const float *x, Py_ssize_t row, const int64_t *rows, int R, int V, const float *inv_t,
                      const double *u, int64_t *token) {
    LogitTask t = {.x = x, .row = row, .rows = rows, .V = V, .inv_t = inv_t, .u = u, .token = token};
    if (R > 0) qm_parallel(R, sample_item, &t);
}
