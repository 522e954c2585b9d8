/* Every decoder block of a step in one call: the NumPy backend's fused path.

A decode step of a small model is ~10 short kernel calls per layer; from Python each costs more
in argument parsing and dispatch than a one-row op takes to run. Here the chain runs in C over the
same C-level ops, in the same order and on the same pool as the separate calls, so its results are
the same bits:

    x = rms_norm(h, attn_norm); qkv = x @ Wqkv.T (+ bias)
    [q, k = head_rms_norm(q, q_norm), head_rms_norm(k, k_norm)]; q, k = rope(q, k); [q *= q_scale]
    pool[slot] = k, v; a = attention(q, pool[, window]) @ Wo.T; [a = rms_norm(a, post_attn_norm)]; h += a
    x = rms_norm(h, mlp_norm); m = act_mul(x @ Wgate_up.T) @ Wdown.T; [m = rms_norm(m, post_mlp_norm)]; h += m

Each layer says which of the bracketed steps it takes, its window, which RoPE tables rotate it
and its activation (SiLU or GELU-tanh): Llama, Mistral and Phi-3 (window, LongRoPE's q scale),
Qwen 3 (q/k norms) and Gemma 3 (all of them, a second RoPE base on local layers) run as one plan.
A plan (decoder_plan) holds each layer's weight buffers and the RoPE tables, parsed once at load;
decoder_run checks a step's arrays once for all layers and updates the residual stream h in place.
*/
#include "_qmatmul.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define MAX_SEGMENTS 3 /* a matrix's parts of different storage (q, k, v at most) */
#define LAYER_ITEMS 16
#define BUFS_PER_LAYER (7 + 4 * MAX_SEGMENTS * 6) /* 7 vectors + 4 matrices of up to 3 segments of 6 buffers */

/* A weight matrix as consecutive column ranges, each its own packed storage (one, nearly always). */
typedef struct {
    QmMatrix seg[MAX_SEGMENTS];
    int start[MAX_SEGMENTS];
    int n;
} DecMatrix;

typedef struct {
    const float *attn_norm, *mlp_norm;
    const float *qkv_bias;                    /* NULL: none */
    const float *q_norm, *k_norm;             /* per-head RMSNorm of q and k before RoPE, or NULL */
    const float *post_attn_norm, *post_mlp_norm; /* RMSNorm of the attention / MLP output, or NULL */
    float norm_eps, q_scale;                  /* q_norm's and k_norm's eps; q's scale after RoPE (1: none) */
    int window, rope, gelu;                   /* keys seen (0: all); RoPE tables; GELU-tanh gate, else SiLU */
    DecMatrix qkv, o, gate_up, down;
} DecLayer;

typedef struct {
    int n_layers, hidden, n_heads, n_kv, hd, inter, n_ropes;
    float eps;
    Py_ssize_t n_pos;         /* positions every RoPE table covers */
    const float **cos, **sin; /* RoPE tables [n_pos, hd / 2] */
    DecLayer *layers;
    Py_buffer *bufs;
    int nbufs;
} DecPlan;

static const char *PLAN_NAME = "edgeserve.decoder_plan";

static void plan_free(DecPlan *p) {
    for (int i = 0; i < p->nbufs; i++) PyBuffer_Release(&p->bufs[i]);
    free(p->bufs);
    free(p->layers);
    free(p->cos);
    free(p->sin);
    free(p);
}

static void plan_capsule_free(PyObject *capsule) {
    plan_free((DecPlan *)PyCapsule_GetPointer(capsule, PLAN_NAME));
}

/* A float32 C-contiguous buffer of n elements held by the plan; NULL with an error set otherwise. */
static const float *plan_floats(DecPlan *p, PyObject *o, Py_ssize_t n, const char *what) {
    Py_buffer *b = &p->bufs[p->nbufs];
    if (PyObject_GetBuffer(o, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return NULL;
    p->nbufs++;
    if (!qm_is_f32(b) || b->len != n * 4) {
        PyErr_Format(PyExc_ValueError, "decoder_plan: %s has the wrong size or type", what);
        return NULL;
    }
    return (const float *)b->buf;
}

/* An optional vector (None: NULL); 0 on success, -1 with an error set. */
static int plan_optional(DecPlan *p, PyObject *o, Py_ssize_t n, const char *what, const float **out) {
    *out = NULL;
    return o == Py_None || (*out = plan_floats(p, o, n, what)) ? 0 : -1;
}

/* A matrix: a list of (first column, gemm's weight arguments) per segment, covering N columns in order. */
static int plan_matrix(DecPlan *p, PyObject *segs, Py_ssize_t K, int N, DecMatrix *m) {
    if (!PyList_Check(segs) || PyList_GET_SIZE(segs) < 1 || PyList_GET_SIZE(segs) > MAX_SEGMENTS) {
        PyErr_Format(PyExc_TypeError, "decoder_plan: a matrix is a list of 1 to %d segments", MAX_SEGMENTS);
        return -1;
    }
    m->n = (int)PyList_GET_SIZE(segs);
    int col = 0;
    for (int i = 0; i < m->n; i++) {
        PyObject *seg = PyList_GET_ITEM(segs, i), *args;
        if (!PyTuple_Check(seg) || PyTuple_GET_SIZE(seg) != 2 || !PyTuple_Check(args = PyTuple_GET_ITEM(seg, 1))) {
            PyErr_SetString(PyExc_TypeError, "decoder_plan: a segment is (first column, gemm's weight arguments)");
            return -1;
        }
        long start = PyLong_AsLong(PyTuple_GET_ITEM(seg, 0));
        if (start == -1 && PyErr_Occurred()) return -1;
        if (qm_matrix_parse(&PyTuple_GET_ITEM(args, 0), (int)PyTuple_GET_SIZE(args), K, &m->seg[i], p->bufs,
                            &p->nbufs) < 0)
            return -1;
        if (start != col) {
            PyErr_SetString(PyExc_ValueError, "decoder_plan: a matrix's segments do not follow each other");
            return -1;
        }
        m->start[i] = col;
        col += m->seg[i].N;
    }
    if (col != N) {
        PyErr_Format(PyExc_ValueError, "decoder_plan: a matrix has %d output columns, expected %d", col, N);
        return -1;
    }
    return 0;
}

/* out[:, :N] = x @ W.T, segment by segment (as qmatmul does from Python). */
static int dec_gemm(const DecMatrix *m, const float *x, int R, float *out, Py_ssize_t ldo) {
    for (int i = 0; i < m->n; i++)
        if (qm_gemm(&m->seg[i], x, R, out + m->start[i], ldo) < 0) return -1;
    return 0;
}

/* A layer's tuple (see decoder_plan); 0 on success, -1 with an error set. */
static int plan_layer(DecPlan *p, PyObject *t, DecLayer *L) {
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != LAYER_ITEMS) {
        PyErr_Format(PyExc_TypeError, "decoder_plan: a layer is a tuple of %d", LAYER_ITEMS);
        return -1;
    }
    PyObject *const *it = &PyTuple_GET_ITEM(t, 0);
    const int hd = p->hd, qkv_n = (p->n_heads + 2 * p->n_kv) * hd;
    if (!(L->attn_norm = plan_floats(p, it[0], p->hidden, "a norm weight")) ||
        plan_optional(p, it[1], qkv_n, "a qkv bias", &L->qkv_bias) < 0 ||
        plan_optional(p, it[2], hd, "a q norm weight", &L->q_norm) < 0 ||
        plan_optional(p, it[3], hd, "a k norm weight", &L->k_norm) < 0 ||
        plan_optional(p, it[4], p->hidden, "a norm weight", &L->post_attn_norm) < 0 ||
        !(L->mlp_norm = plan_floats(p, it[5], p->hidden, "a norm weight")) ||
        plan_optional(p, it[6], p->hidden, "a norm weight", &L->post_mlp_norm) < 0 ||
        plan_matrix(p, it[7], p->hidden, qkv_n, &L->qkv) < 0 ||
        plan_matrix(p, it[8], (Py_ssize_t)p->n_heads * hd, p->hidden, &L->o) < 0 ||
        plan_matrix(p, it[9], p->hidden, 2 * p->inter, &L->gate_up) < 0 ||
        plan_matrix(p, it[10], p->inter, p->hidden, &L->down) < 0)
        return -1;
    const double norm_eps = PyFloat_AsDouble(it[11]), q_scale = PyFloat_AsDouble(it[12]);
    const long window = PyLong_AsLong(it[13]), rope = PyLong_AsLong(it[14]);
    const int gelu = PyObject_IsTrue(it[15]);
    if (PyErr_Occurred()) return -1;
    const char *bad = !L->q_norm != !L->k_norm             ? "has one head norm (both or neither)"
                      : window < 0 || window > INT32_MAX ? "has a window outside 0 (none) .. 2^31 - 1"
                      : rope < 0 || rope >= p->n_ropes   ? "names no RoPE table of the plan"
                                                         : NULL;
    if (bad) {
        PyErr_Format(PyExc_ValueError, "decoder_plan: a layer %s", bad);
        return -1;
    }
    L->norm_eps = (float)norm_eps;
    L->q_scale = (float)q_scale;
    L->window = (int)window;
    L->rope = (int)rope;
    L->gelu = gelu;
    return 0;
}

/* decoder_plan(hidden, n_heads, n_kv_heads, head_dim, intermediate, eps, layers, ropes) -> plan.
   layers: one tuple per layer (attn_norm, qkv_bias, q_norm, k_norm, post_attn_norm, mlp_norm,
   post_mlp_norm, qkv, o, gate_up, down, norm_eps, q_scale, window, rope, gelu): vectors float32, the
   optional ones None where a layer has none; each matrix a list of (first column, gemm's weight
   arguments (w, scales, biases, N, bits, group, f16[, hi, hbits, sc, m])); window 0 for none; rope
   an index into ropes, a list of (cos, sin) float32 [positions, head_dim / 2], all as long. */
PyObject *qm_py_decoder_plan(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 8 || !PyList_Check(args[6]) || !PyList_Check(args[7])) {
        PyErr_SetString(PyExc_TypeError, "decoder_plan takes 8 arguments, the last two lists");
        return NULL;
    }
    long dims[5];
    for (int i = 0; i < 5; i++) dims[i] = PyLong_AsLong(args[i]);
    double eps = PyFloat_AsDouble(args[5]);
    if (PyErr_Occurred()) return NULL;
    const Py_ssize_t n_layers = PyList_GET_SIZE(args[6]), n_ropes = PyList_GET_SIZE(args[7]);
    DecPlan *p = (DecPlan *)calloc(1, sizeof(DecPlan));
    if (!p) return PyErr_NoMemory();
    p->layers = (DecLayer *)calloc((size_t)n_layers + 1, sizeof(DecLayer));
    p->bufs = (Py_buffer *)calloc((size_t)n_layers * BUFS_PER_LAYER + 2 * (size_t)n_ropes + 1, sizeof(Py_buffer));
    p->cos = (const float **)calloc((size_t)n_ropes + 1, sizeof(float *));
    p->sin = (const float **)calloc((size_t)n_ropes + 1, sizeof(float *));
    if (!p->layers || !p->bufs || !p->cos || !p->sin) {
        plan_free(p);
        return PyErr_NoMemory();
    }
    *p = (DecPlan){.n_layers = (int)n_layers, .hidden = (int)dims[0], .n_heads = (int)dims[1], .n_kv = (int)dims[2],
                   .hd = (int)dims[3], .inter = (int)dims[4], .n_ropes = (int)n_ropes, .eps = (float)eps,
                   .cos = p->cos, .sin = p->sin, .layers = p->layers, .bufs = p->bufs};
    if (p->hidden <= 0 || p->n_kv <= 0 || p->n_heads % p->n_kv || p->hd <= 0 || p->hd % 2 || p->inter <= 0 ||
        n_ropes < 1) {
        plan_free(p);
        PyErr_SetString(PyExc_ValueError, "decoder_plan: bad model dimensions, or no RoPE tables");
        return NULL;
    }
    if (p->hd > QM_MAX_HEAD_DIM) { /* attention's kernels do not take it: the model runs block by block */
        plan_free(p);
        Py_RETURN_NONE;
    }
    const Py_ssize_t half = p->hd / 2;
    for (Py_ssize_t r = 0; r < n_ropes; r++) {
        PyObject *t = PyList_GET_ITEM(args[7], r);
        Py_buffer *b;
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 2) {
            PyErr_SetString(PyExc_TypeError, "decoder_plan: RoPE tables are (cos, sin) pairs");
            goto fail;
        }
        for (int j = 0; j < 2; j++) {
            b = &p->bufs[p->nbufs];
            if (PyObject_GetBuffer(PyTuple_GET_ITEM(t, j), b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) goto fail;
            p->nbufs++;
            if (!qm_is_f32(b) || b->ndim != 2 || b->shape[1] != half || (r + j && b->shape[0] != p->n_pos)) {
                PyErr_SetString(PyExc_ValueError, "decoder_plan: RoPE tables are float32 [positions, head_dim / 2], "
                                                  "all of one length");
                goto fail;
            }
            p->n_pos = b->shape[0];
            (j ? p->sin : p->cos)[r] = (const float *)b->buf;
        }
    }
    for (Py_ssize_t i = 0; i < n_layers; i++)
        if (plan_layer(p, PyList_GET_ITEM(args[6], i), &p->layers[i]) < 0) goto fail;
    PyObject *capsule = PyCapsule_New(p, PLAN_NAME, plan_capsule_free);
    if (!capsule) plan_free(p);
    return capsule;
fail:
    plan_free(p);
    return NULL;
}

/* Scratch for a step's activations, grown as needed; used with qm_call_lock held. */
static float *g_scratch;
static size_t g_scratch_cap;

/* Room for `need` floats of scratch; -1 when out of memory. */
static int grow_scratch(size_t need) {
    if (need <= g_scratch_cap) return 0;
    float *grown = (float *)realloc(g_scratch, need * sizeof(float));
    if (!grown) return -1;
    g_scratch = grown;
    g_scratch_cap = need;
    return 0;
}

/* Where run_layers keeps each activation of T rows in a scratch buffer, and the floats it needs. */
typedef struct {
    size_t x;    /* normed input [T, hidden], then the gate's output [T, inter] */
    size_t qkv;  /* [T, qkv_n], then gate | up [T, 2 * inter] */
    size_t qk;   /* roped q | k [T, H + nkv, hd] */
    size_t att;  /* attention output [T, H, hd] */
    size_t y;    /* a block's output [T, hidden] */
    size_t rope; /* each RoPE table's cos then sin at the rows' positions [T, hd / 2] */
    size_t total;
} Scratch;

static Scratch scratch_layout(const DecPlan *p, size_t T) {
    const size_t H = p->n_heads, nkv = p->n_kv, hd = p->hd, hidden = p->hidden, inter = p->inter;
    const size_t qkv_n = (H + 2 * nkv) * hd;
    Scratch s = {.x = 0};
    s.qkv = s.x + T * (hidden > inter ? hidden : inter);
    s.qk = s.qkv + T * (qkv_n > 2 * inter ? qkv_n : 2 * inter);
    s.att = s.qk + T * (H + nkv) * hd;
    s.y = s.att + T * H * hd;
    s.rope = s.y + T * hidden;
    s.total = s.rope + (size_t)p->n_ropes * T * hd;
    return s;
}

static void add_rows(float *h, const float *y, size_t n) {
    for (size_t i = 0; i < n; i++) h[i] += y[i];
}

/* Every layer on h [T, hidden]; -1 when out of memory. */
static int run_layers(const DecPlan *p, float *h, int T, void *const *kc, void *const *vc, int kv_type, int bs,
                      const int64_t *positions, const int64_t *slots, const int64_t *bt, Py_ssize_t bt_row,
                      const int64_t *lens) {
    const int H = p->n_heads, nkv = p->n_kv, hd = p->hd, hidden = p->hidden, inter = p->inter;
    const int qkv_n = (H + 2 * nkv) * hd, k_end = (H + nkv) * hd;
    const size_t half = (size_t)hd / 2, ht = (size_t)T * hidden;
    const Scratch at = scratch_layout(p, (size_t)T);
    float *x = g_scratch + at.x, *qkv = g_scratch + at.qkv, *qk = g_scratch + at.qk, *att = g_scratch + at.att,
          *y = g_scratch + at.y, *rope = g_scratch + at.rope;
    /* cos and sin rows at the step's positions, as the backend's step meta holds them */
    for (int r = 0; r < p->n_ropes; r++)
        for (int t = 0; t < T; t++) {
            float *c = rope + ((size_t)r * 2 * T + t) * half, *s = c + (size_t)T * half;
            memcpy(c, p->cos[r] + (size_t)positions[t] * half, half * sizeof(float));
            memcpy(s, p->sin[r] + (size_t)positions[t] * half, half * sizeof(float));
        }
    const float scale = (float)(1.0 / sqrt((double)hd));
    for (int l = 0; l < p->n_layers; l++) {
        const DecLayer *L = &p->layers[l];
        const float *cos = rope + (size_t)L->rope * 2 * T * half, *sin = cos + (size_t)T * half;
        qm_rms_norm(h, hidden, L->attn_norm, x, hidden, T, hidden, p->eps);
        if (dec_gemm(&L->qkv, x, T, qkv, qkv_n) < 0) return -1;
        if (L->qkv_bias)
            for (int t = 0; t < T; t++) add_rows(qkv + (size_t)t * qkv_n, L->qkv_bias, (size_t)qkv_n);
        if (L->q_norm) {
            qm_head_rms_norm(qkv, qkv_n, L->q_norm, T, H, hd, L->norm_eps);
            qm_head_rms_norm(qkv + (size_t)H * hd, qkv_n, L->k_norm, T, nkv, hd, L->norm_eps);
        }
        qm_rope(qkv, qkv_n, cos, sin, qk, T, H + nkv, hd);
        if (L->q_scale != 1.f)
            for (int t = 0; t < T; t++)
                for (int i = 0; i < H * hd; i++) qk[(size_t)t * k_end + i] *= L->q_scale;
        qm_write_kv(kc[l], kv_type, qk + (size_t)H * hd, k_end, slots, T, nkv, hd);
        qm_write_kv(vc[l], kv_type, qkv + k_end, qkv_n, slots, T, nkv, hd);
        if (qm_attention(qk, k_end, kc[l], vc[l], kv_type, bs, nkv, bt, bt_row, lens, T, H, hd, scale, L->window, att) < 0 ||
            dec_gemm(&L->o, att, T, y, hidden) < 0)
            return -1;
        if (L->post_attn_norm) qm_rms_norm(y, hidden, L->post_attn_norm, y, hidden, T, hidden, p->eps);
        add_rows(h, y, ht);
        qm_rms_norm(h, hidden, L->mlp_norm, x, hidden, T, hidden, p->eps);
        if (dec_gemm(&L->gate_up, x, T, qkv, 2 * inter) < 0) return -1;
        if (L->gelu)
            qm_gelu_tanh_mul(qkv, 2 * inter, x, inter, T, inter);
        else
            qm_silu_mul(qkv, 2 * inter, x, inter, T, inter);
        if (dec_gemm(&L->down, x, T, y, hidden) < 0) return -1;
        if (L->post_mlp_norm) qm_rms_norm(y, hidden, L->post_mlp_norm, y, hidden, T, hidden, p->eps);
        add_rows(h, y, ht);
    }
    return 0;
}

/* The pools of every layer: C-contiguous [blocks, bs, n_kv, head], all of one shape and QM_KV type. */
static int take_pools(PyObject *list, const DecPlan *p, Py_buffer *b, int *held, void **ptrs, Py_ssize_t *shape,
                      int *kv_type) {
    if (!PyList_Check(list) || PyList_GET_SIZE(list) != p->n_layers) {
        PyErr_SetString(PyExc_ValueError, "decoder_run: one K and one V pool per layer");
        return -1;
    }
    for (int l = 0; l < p->n_layers; l++) {
        Py_buffer *pb = &b[*held];
        if (PyObject_GetBuffer(PyList_GET_ITEM(list, l), pb, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0)
            return -1;
        (*held)++;
        const int type = qm_kv_type(pb, p->hd);
        if (type < 0 || (*kv_type >= 0 && type != *kv_type) || pb->shape[2] != p->n_kv ||
            (shape[0] && (pb->shape[0] != shape[0] || pb->shape[1] != shape[1]))) {
            PyErr_SetString(PyExc_ValueError, "decoder_run: a KV pool has the wrong shape or type");
            return -1;
        }
        shape[0] = pb->shape[0];
        shape[1] = pb->shape[1];
        *kv_type = type;
        ptrs[l] = pb->buf;
    }
    return 0;
}

/* decoder_run(plan, h, k_pools, v_pools, positions, slots, block_tables, context_lens): every layer of
   the plan on the residual stream h float32 [T, hidden] (C-contiguous, updated in place); this
   step's K/V rows go to `slots` of each layer's pools; positions int64 [T] (RoPE); block_tables
   int64 [T, max_blocks] and context_lens int64 [T] as for attention. */
PyObject *qm_py_decoder_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "decoder_run takes 8 arguments");
        return NULL;
    }
    const DecPlan *p = (const DecPlan *)PyCapsule_GetPointer(args[0], PLAN_NAME);
    if (!p) return NULL;
    const int n = p->n_layers;
    Py_buffer *b = (Py_buffer *)calloc(2 * (size_t)n + 5, sizeof(Py_buffer));
    void **pools = (void **)calloc(2 * (size_t)n + 1, sizeof(void *));
    int held = 0, err = 0, kv_type = -1;
    PyObject *result = NULL;
    Py_ssize_t shape[2] = {0, 0};
    if (!b || !pools) {
        PyErr_NoMemory();
        goto done;
    }
    PyObject *arrays[5] = {args[1], args[4], args[5], args[6], args[7]};
    for (int i = 0; i < 5; i++) {
        int flags = (i == 3 ? PyBUF_STRIDES : PyBUF_C_CONTIGUOUS) | PyBUF_FORMAT | (i == 0 ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(arrays[i], &b[held], flags) < 0) goto done;
        held++;
    }
    Py_buffer *h = &b[0], *ps = &b[1], *sl = &b[2], *bt = &b[3], *cl = &b[4];
    const Py_ssize_t T = h->ndim == 2 ? h->shape[0] : -1;
    if (!qm_is_f32(h) || h->ndim != 2 || h->shape[1] != p->hidden || !qm_is_i64(ps) || ps->ndim != 1 ||
        ps->shape[0] != T || !qm_is_i64(sl) || sl->ndim != 1 || sl->shape[0] != T || !qm_is_i64(bt) ||
        bt->ndim != 2 || bt->shape[0] != T || (bt->shape[1] > 1 && bt->strides[1] != 8) || bt->strides[0] % 8 ||
        bt->strides[0] < 0 || !qm_is_i64(cl) || cl->ndim != 1 || cl->shape[0] != T) {
        PyErr_SetString(PyExc_ValueError, "decoder_run: bad shapes or types");
        goto done;
    }
    if (take_pools(args[2], p, b, &held, pools, shape, &kv_type) < 0 ||
        take_pools(args[3], p, b, &held, pools + n, shape, &kv_type) < 0)
        goto done;
    const Py_ssize_t rows = shape[0] * shape[1];
    const int64_t *positions = (const int64_t *)ps->buf, *slots = (const int64_t *)sl->buf,
                  *lens = (const int64_t *)cl->buf;
    for (Py_ssize_t t = 0; t < T; t++) {
        const char *bad = slots[t] < 0 || slots[t] >= rows                      ? "slot falls outside the pool"
                          : positions[t] < 0 || positions[t] >= p->n_pos ? "position falls outside the RoPE tables"
                                                                             : NULL;
        if (bad) {
            PyErr_Format(PyExc_ValueError, "decoder_run: row %zd's %s", t, bad);
            goto done;
        }
    }
    const Py_ssize_t bt_row = T > 1 ? bt->strides[0] / 8 : 0;
    const int bad = qm_bad_table_row((const int64_t *)bt->buf, bt_row, bt->shape[1], lens, (int)T, (int)shape[1],
                                     shape[0]);
    if (bad >= 0) {
        PyErr_Format(PyExc_ValueError, "decoder_run: row %d's context length or block ids fall outside the pool", bad);
        goto done;
    }
    const size_t need = scratch_layout(p, (size_t)T).total;
    WITH_POOL(err = grow_scratch(need) < 0 ||
                    run_layers(p, (float *)h->buf, (int)T, pools, pools + n, kv_type, (int)shape[1], positions, slots,
                               (const int64_t *)bt->buf, bt_row, lens) < 0);
    if (err) {
        PyErr_NoMemory();
        goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    while (held > 0) PyBuffer_Release(&b[--held]);
    free(b);
    free(pools);
    return result;
}
