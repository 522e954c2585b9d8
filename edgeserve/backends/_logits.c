/* Rows of logits for the engine's sampler (engine/sampler.py): each row's log-normalizer and top k
entries (logprobs), and a token drawn from a row at a temperature, after its top-k, min-p and top-p cuts.

A row of a 49,152-token vocabulary took NumPy 0.5-0.8 ms to sample (float64 copies, sorts for top-p, a
cumulative sum) and more for its top 20 logprobs (a partition): a 135M model's decode step of one
chat spent a seventh of its time there, and a step of 16 sampled answers with logprobs as long as in
the model. Here a row is one item on the pool and two or three passes:
its max; then the sum of its exponentials, in float32 (exp_poly) summed in float64 as NumPy's path
does; then the draw, which adds them up again until it passes u times the sum. The top k go along
with the max: a chunk of LG_CHUNK logits is looked at one by one only where its max beats the k-th
best so far, which after the first few chunks is almost never. The cuts are NumPy's path's: top-k keeps
the logits at least the k-th largest, min-p the weights at least min_p times the largest, top-p the
likeliest tokens (of the QM_MAX_TOP likeliest: a row that needs more is left to the caller) until they
reach top_p of the weight left, drawn from in id order.

An exponential below exp's range is zero, as in NumPy (a grammar's masked logit, -1e30, never comes
up), and so is a NaN logit's. Rows whose max is not finite (inf) or is masked are left to the caller.
Code paths: AVX-512, AVX2 and portable C for the passes; the draw's last step and the top k are
scalar. */
#include "_qmatmul.h"
#include "_vmath.h"

#include <math.h>

#define LG_CHUNK 64
#define LG_FEW 32 /* top-p's first look: its likeliest tokens */
#define EXP_FLOOR -87.3f /* exp_poly's lower clamp: below it an exponential is zero */

typedef struct {
    const float *x;
    Py_ssize_t row; /* floats between rows */
    const int64_t *rows;
    int V, k;
    double *norm;              /* logit_stats: log-normalizers */
    int64_t *top;              /* and each row's top k, k apart */
    const float *inv_t;        /* sample: 1 / temperature, */
    const int32_t *top_k;      /* the cuts (top_k 0: none), */
    const float *top_p, *min_p;
    const double *u;           /* a uniform draw in [0, 1), */
    int64_t *token;            /* and the token drawn (-1: left to the caller) */
} LogitTask;

/* ---- the passes, by code path ---- */

static float max_generic(const float *x, int n) {
    float m = -INFINITY;
    for (int i = 0; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

/* How a row's logits become weights: exp((x - m) * s), zero below the floor `lo` (top-k's k-th largest logit)
   and where under min_p (the largest weight being 1). */
typedef struct {
    float m, s, lo, min_p;
} Weights;

static inline __attribute__((always_inline)) float weight(float x, Weights w) {
    const float a = (x - w.m) * w.s;
    const float e = a >= EXP_FLOOR ? exp_poly(a) : 0.f; /* NaN too: no weight */
    return x >= w.lo && e >= w.min_p ? e : 0.f;
}

static double expsum_generic(const float *x, int n, Weights w) {
    double total = 0.0;
    for (int i = 0; i < n; i++) total += weight(x[i], w);
    return total;
}

/* The first i with cum + e_0 + ... + e_i > target, cum updated; -1 where the row's end comes first. */
static int draw_generic(const float *x, int n, Weights w, double target, double *cum) {
    for (int i = 0; i < n; i++) {
        *cum += weight(x[i], w);
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

static inline LG_AVX512 __attribute__((always_inline)) __m512 weights512(__m512 x, Weights w) {
    const __m512 a = _mm512_mul_ps(_mm512_sub_ps(x, _mm512_set1_ps(w.m)), _mm512_set1_ps(w.s));
    const __mmask16 live = _mm512_cmp_ps_mask(a, _mm512_set1_ps(EXP_FLOOR), _CMP_GE_OQ) &
                           _mm512_cmp_ps_mask(x, _mm512_set1_ps(w.lo), _CMP_GE_OQ);
    const __m512 e = _mm512_maskz_mov_ps(live, exp512(a));
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(e, _mm512_set1_ps(w.min_p), _CMP_GE_OQ), e);
}

static inline LG_AVX512 __attribute__((always_inline)) __m512d low_pd(__m512 e) {
    return _mm512_cvtps_pd(_mm512_castps512_ps256(e));
}

static inline LG_AVX512 __attribute__((always_inline)) __m512d high_pd(__m512 e) {
    return _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
}

static LG_AVX512 double expsum_avx512(const float *x, int n, Weights w) {
    __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 e = weights512(_mm512_loadu_ps(x + i), w);
        lo = _mm512_add_pd(lo, low_pd(e));
        hi = _mm512_add_pd(hi, high_pd(e));
    }
    return _mm512_reduce_add_pd(_mm512_add_pd(lo, hi)) + expsum_generic(x + i, n - i, w);
}

static LG_AVX512 int draw_avx512(const float *x, int n, Weights w, double target, double *cum) {
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 e = weights512(_mm512_loadu_ps(x + i), w);
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
    const int j = draw_generic(x + i, n - i, w, target, cum);
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

static inline LG_AVX2 __attribute__((always_inline)) __m256 weights256(__m256 x, Weights w) {
    const __m256 a = _mm256_mul_ps(_mm256_sub_ps(x, _mm256_set1_ps(w.m)), _mm256_set1_ps(w.s));
    const __m256 live = _mm256_and_ps(_mm256_cmp_ps(a, _mm256_set1_ps(EXP_FLOOR), _CMP_GE_OQ),
                                      _mm256_cmp_ps(x, _mm256_set1_ps(w.lo), _CMP_GE_OQ));
    const __m256 e = _mm256_and_ps(live, exp256(a));
    return _mm256_and_ps(_mm256_cmp_ps(e, _mm256_set1_ps(w.min_p), _CMP_GE_OQ), e);
}

static inline LG_AVX2 __attribute__((always_inline)) __m256d sum_pd(__m256 e) {
    return _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(e)), _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
}

static inline LG_AVX2 __attribute__((always_inline)) double reduce_pd(__m256d v) {
    double lanes[4];
    _mm256_storeu_pd(lanes, v);
    return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
}

static LG_AVX2 double expsum_avx2(const float *x, int n, Weights w) {
    __m256d acc = _mm256_setzero_pd();
    int i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_add_pd(acc, sum_pd(weights256(_mm256_loadu_ps(x + i), w)));
    return reduce_pd(acc) + expsum_generic(x + i, n - i, w);
}

static LG_AVX2 int draw_avx2(const float *x, int n, Weights w, double target, double *cum) {
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 e = weights256(_mm256_loadu_ps(x + i), w);
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
    const int j = draw_generic(x + i, n - i, w, target, cum);
    return j < 0 ? -1 : i + j;
}
#endif

typedef struct {
    float (*max)(const float *, int);
    double (*expsum)(const float *, int, Weights);
    int (*draw)(const float *, int, Weights, double, double *);
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

/* The k largest entries of row x (vals, ids: descending, of equal ones the lower id first; NaN never), their
count, and the row's max in *m. */
static int best_of(const Passes *p, const float *x, int V, int k, float *vals, int64_t *ids, float *m) {
    int n = 0;
    *m = k ? -INFINITY : p->max(x, V);
    for (int c = 0; k && c < V; c += LG_CHUNK) {
        const int len = V - c < LG_CHUNK ? V - c : LG_CHUNK;
        const float cm = p->max(x + c, len);
        *m = cm > *m ? cm : *m;
        if (n == k && !(cm > vals[k - 1])) continue;
        for (int j = c; j < c + len; j++)
            if (x[j] == x[j]) keep_best(vals, ids, &n, k, x[j], j);
    }
    return n;
}

static void stats_item(const void *ctx, int i) {
    const LogitTask *t = (const LogitTask *)ctx;
    const Passes p = passes();
    const float *x = t->x + (size_t)t->rows[i] * t->row;
    float vals[QM_MAX_TOP], m;
    best_of(&p, x, t->V, t->k, vals, t->top + (size_t)i * t->k, &m);
    t->norm[i] = isfinite(m) ? m + log(p.expsum(x, t->V, (Weights){m, 1.f, -INFINITY, 0.f})) : NAN;
}

/* The top-p draw: of the n likeliest tokens (ids, vals: descending), the fewest whose weights reach top_p of
   the total, and among those the token u falls on, in id order as NumPy's cumulative sum over the row takes
   them; -1 where the n fall short. */
static int64_t draw_top_p(const float *vals, const int64_t *ids, int n, Weights w, double total, float top_p,
                          double u) {
    const double target = top_p * total;
    float wts[QM_MAX_TOP];
    int64_t order[QM_MAX_TOP];
    double cum = 0.0;
    int kept = 0;
    do { /* the likeliest at least, whatever top_p (a tiny one is 0 in float32) */
        wts[kept] = weight(vals[kept], w);
        order[kept] = ids[kept];
        cum += wts[kept++];
    } while (kept < n && cum < target);
    if (cum < target) return -1;
    for (int a = 1; a < kept; a++)
        for (int b = a; b > 0 && order[b] < order[b - 1]; b--) {
            const int64_t id = order[b];
            const float e = wts[b];
            order[b] = order[b - 1], wts[b] = wts[b - 1];
            order[b - 1] = id, wts[b - 1] = e;
        }
    double sum = 0.0;
    for (int a = 0; a < kept; a++) sum += wts[a];
    cum = 0.0;
    for (int a = 0; a < kept; a++)
        if ((cum += wts[a]) > u * sum) return order[a];
    return order[kept - 1];
}

static void sample_item(const void *ctx, int i) {
    const LogitTask *t = (const LogitTask *)ctx;
    const Passes p = passes();
    const float *x = t->x + (size_t)t->rows[i] * t->row;
    const int top_k = t->top_k[i] > 0 && t->top_k[i] < t->V ? t->top_k[i] : 0, top_p = t->top_p[i] < 1.f;
    t->token[i] = -1;
    if (top_k > QM_MAX_TOP) return;
    float vals[QM_MAX_TOP], m;
    int64_t ids[QM_MAX_TOP];
    /* top-p looks at the LG_FEW likeliest first: keeping the k best costs k / 2 moves an entry, and a real
       model's top_p of its weight is nearly always in a few tokens */
    int n = best_of(&p, x, t->V, top_k ? top_k : top_p ? LG_FEW : 0, vals, ids, &m);
    if (!isfinite(m) || m <= -QM_LOGIT_LIMIT) return;
    /* top-k keeps every logit at least the k-th largest, ties beyond k included */
    const Weights w = {m, t->inv_t[i], top_k ? vals[top_k - 1] : -INFINITY, t->min_p[i]};
    const double total = p.expsum(x, t->V, w);
    if (!(total > 0.0) || !isfinite(total)) return;
    if (top_p) { /* the n are the likeliest; top-k's ties beyond k are not among them, so they may fall short */
        t->token[i] = draw_top_p(vals, ids, n, w, total, t->top_p[i], t->u[i]);
        if (t->token[i] < 0 && !top_k && n == LG_FEW) {
            n = best_of(&p, x, t->V, QM_MAX_TOP, vals, ids, &m);
            t->token[i] = draw_top_p(vals, ids, n, w, total, t->top_p[i], t->u[i]);
        }
        return;
    }
    double cum = 0.0;
    int token = p.draw(x, t->V, w, t->u[i] * total, &cum);
    /* past the end only by rounding (the draw's sums are in another order than the total's): the last token with
       a weight */
    for (int j = t->V - 1; token < 0 && j >= 0; j--)
        if (weight(x[j], w) > 0.f) token = j;
    t->token[i] = token;
}

void qm_logit_stats(const float *x, Py_ssize_t row, const int64_t *rows, int R, int V, int k, double *norm,
                    int64_t *top) {
    LogitTask t = {.x = x, .row = row, .rows = rows, .V = V, .k = k, .norm = norm, .top = top};
    if (R > 0) qm_parallel(R, stats_item, &t);
}

void qm_sample_logits(const float *x, Py_ssize_t row, const int64_t *rows, int R, int V, const float *inv_t,
                      const int32_t *top_k, const float *top_p, const float *min_p, const double *u, int64_t *token) {
    LogitTask t = {.x = x, .row = row, .rows = rows, .V = V, .inv_t = inv_t, .top_k = top_k, .top_p = top_p,
                   .min_p = min_p, .u = u, .token = token};
    if (R > 0) qm_parallel(R, sample_item, &t);
}
