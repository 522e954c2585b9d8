/* Every Llama decoder block of a step in one call: the NumPy backend's fused path.

A decode step of a small model is ~10 short kernel calls per layer; from Python each costs more
in argument parsing and dispatch than a one-row op takes to run. Here the chain runs in C over the
same C-level ops, in the same order and on the same pool as the separate calls, so its results are
the same bits:

    x = rms_norm(h, attn_norm); qkv = x @ Wqkv.T (+ bias); q, k = rope(q, k); pool[slot] = k, v
    h += attention(q, pool) @ Wo.T
    x = rms_norm(h, mlp_norm); h += silu_mul(x @ Wgate_up.T) @ Wdown.T

A plan (decoder_plan) holds each layer's weight buffers, parsed once at load; decoder_run checks a
step's arrays once for all layers and updates the residual stream h in place.
*/
#include "_qmatmul.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define BUFS_PER_LAYER 27 /* 3 vectors + 4 matrices of up to 6 buffers */

typedef struct {
    const float *attn_norm, *mlp_norm, *qkv_bias; /* qkv_bias may be NULL */
    QmMatrix qkv, o, gate_up, down;
} DecLayer;

typedef struct {
    int n_layers, hidden, n_heads, n_kv, hd, inter;
    float eps;
    DecLayer *layers;
    Py_buffer *bufs;
    int nbufs;
} DecPlan;

static const char *PLAN_NAME = "edgeserve.decoder_plan";

static void plan_free(DecPlan *p) {
    for (int i = 0; i < p->nbufs; i++) PyBuffer_Release(&p->bufs[i]);
    free(p->bufs);
    free(p->layers);
    free(p);
}

static void plan_capsule_free(PyObject *capsule) {
    plan_free((DecPlan *)PyCapsule_GetPointer(capsule, PLAN_NAME));
}

/* A float32 vector of n elements, its buffer held by the plan; NULL with an error set otherwise. */
static const float *plan_vector(DecPlan *p, PyObject *o, Py_ssize_t n) {
    Py_buffer *b = &p->bufs[p->nbufs];
    if (PyObject_GetBuffer(o, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return NULL;
    p->nbufs++;
    if (b->itemsize != 4 || strcmp(b->format, "f") || b->len != n * 4) {
        PyErr_SetString(PyExc_ValueError, "decoder_plan: a norm weight or bias has the wrong size or type");
        return NULL;
    }
    return (const float *)b->buf;
}

static int plan_matrix(DecPlan *p, PyObject *args, Py_ssize_t K, int N, QmMatrix *m) {
    if (!PyTuple_Check(args)) {
        PyErr_SetString(PyExc_TypeError, "decoder_plan: a matrix is a tuple of gemm's weight arguments");
        return -1;
    }
    if (qm_matrix_parse(&PyTuple_GET_ITEM(args, 0), (int)PyTuple_GET_SIZE(args), K, m, p->bufs, &p->nbufs) < 0)
        return -1;
    if (m->N != N) {
        PyErr_Format(PyExc_ValueError, "decoder_plan: a matrix has %d output columns, expected %d", m->N, N);
        return -1;
    }
    return 0;
}

/* decoder_plan(hidden, n_heads, n_kv_heads, head_dim, intermediate, eps, layers) -> plan.
   layers: one tuple per layer (attn_norm, qkv_bias or None, mlp_norm, qkv, o, gate_up, down), each
   matrix a tuple of gemm's weight arguments (w, scales, biases, N, bits, group, f16[, hi, hbits, sc, m]). */
PyObject *qm_py_decoder_plan(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 7 || !PyList_Check(args[6])) {
        PyErr_SetString(PyExc_TypeError, "decoder_plan takes 7 arguments, the last a list");
        return NULL;
    }
    long dims[5];
    for (int i = 0; i < 5; i++) dims[i] = PyLong_AsLong(args[i]);
    double eps = PyFloat_AsDouble(args[5]);
    if (PyErr_Occurred()) return NULL;
    const Py_ssize_t n_layers = PyList_GET_SIZE(args[6]);
    DecPlan *p = (DecPlan *)calloc(1, sizeof(DecPlan));
    if (!p) return PyErr_NoMemory();
    p->layers = (DecLayer *)calloc((size_t)n_layers + 1, sizeof(DecLayer));
    p->bufs = (Py_buffer *)calloc((size_t)n_layers * BUFS_PER_LAYER + 1, sizeof(Py_buffer));
    if (!p->layers || !p->bufs) {
        plan_free(p);
        return PyErr_NoMemory();
    }
    *p = (DecPlan){.n_layers = (int)n_layers, .hidden = (int)dims[0], .n_heads = (int)dims[1], .n_kv = (int)dims[2],
                   .hd = (int)dims[3], .inter = (int)dims[4], .eps = (float)eps, .layers = p->layers, .bufs = p->bufs};
    if (p->hidden <= 0 || p->n_kv <= 0 || p->n_heads % p->n_kv || p->hd <= 0 || p->hd % 2 || p->inter <= 0) {
        plan_free(p);
        PyErr_SetString(PyExc_ValueError, "decoder_plan: bad model dimensions");
        return NULL;
    }
    const int qkv_n = (p->n_heads + 2 * p->n_kv) * p->hd;
    for (Py_ssize_t i = 0; i < n_layers; i++) {
        PyObject *t = PyList_GET_ITEM(args[6], i);
        DecLayer *L = &p->layers[i];
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 7) {
            PyErr_SetString(PyExc_TypeError, "decoder_plan: a layer is a tuple of 7");
            goto fail;
        }
        PyObject *bias = PyTuple_GET_ITEM(t, 1);
        if (!(L->attn_norm = plan_vector(p, PyTuple_GET_ITEM(t, 0), p->hidden)) ||
            (bias != Py_None && !(L->qkv_bias = plan_vector(p, bias, qkv_n))) ||
            !(L->mlp_norm = plan_vector(p, PyTuple_GET_ITEM(t, 2), p->hidden)) ||
            plan_matrix(p, PyTuple_GET_ITEM(t, 3), p->hidden, qkv_n, &L->qkv) < 0 ||
            plan_matrix(p, PyTuple_GET_ITEM(t, 4), (Py_ssize_t)p->n_heads * p->hd, p->hidden, &L->o) < 0 ||
            plan_matrix(p, PyTuple_GET_ITEM(t, 5), p->hidden, 2 * p->inter, &L->gate_up) < 0 ||
            plan_matrix(p, PyTuple_GET_ITEM(t, 6), p->inter, p->hidden, &L->down) < 0)
            goto fail;
    }
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
    size_t x;   /* normed input [T, hidden], then the SiLU gate's output [T, inter] */
    size_t qkv; /* [T, qkv_n], then gate | up [T, 2 * inter] */
    size_t qk;  /* roped q | k [T, H + nkv, hd] */
    size_t att; /* attention output [T, H, hd] */
    size_t y;   /* a block's output [T, hidden] */
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
    s.total = s.y + T * hidden;
    return s;
}

/* Every layer on h [T, hidden]; -1 when out of memory. */
static int run_layers(const DecPlan *p, float *h, int T, float *const *kc, float *const *vc, int bs,
                       const float *cos, const float *sin, const int64_t *slots, const int64_t *bt, Py_ssize_t bt_row,
                       const int64_t *lens) {
    const int H = p->n_heads, nkv = p->n_kv, hd = p->hd, hidden = p->hidden, inter = p->inter;
    const int qkv_n = (H + 2 * nkv) * hd, k_end = (H + nkv) * hd;
    const size_t kv_row = (size_t)nkv * hd;
    const Scratch at = scratch_layout(p, (size_t)T);
    float *x = g_scratch + at.x, *qkv = g_scratch + at.qkv, *qk = g_scratch + at.qk, *att = g_scratch + at.att,
          *y = g_scratch + at.y;
    const float scale = (float)(1.0 / sqrt((double)hd));
    for (int l = 0; l < p->n_layers; l++) {
        const DecLayer *L = &p->layers[l];
        qm_rms_norm(h, hidden, L->attn_norm, x, hidden, T, hidden, p->eps);
        if (qm_gemm(&L->qkv, x, T, qkv, qkv_n) < 0) return -1;
        if (L->qkv_bias)
            for (int t = 0; t < T; t++)
                for (int j = 0; j < qkv_n; j++) qkv[(size_t)t * qkv_n + j] += L->qkv_bias[j];
        qm_rope(qkv, qkv_n, cos, sin, qk, T, H + nkv, hd);
        qm_write_kv(kc[l], qk + (size_t)H * hd, k_end, slots, T, kv_row);
        qm_write_kv(vc[l], qkv + k_end, qkv_n, slots, T, kv_row);
        if (qm_attention(qk, k_end, kc[l], vc[l], bs, nkv, bt, bt_row, lens, T, H, hd, scale, 0, att) < 0 ||
            qm_gemm(&L->o, att, T, y, hidden) < 0)
            return -1;
        for (size_t i = 0; i < (size_t)T * hidden; i++) h[i] += y[i];
        qm_rms_norm(h, hidden, L->mlp_norm, x, hidden, T, hidden, p->eps);
        if (qm_gemm(&L->gate_up, x, T, qkv, 2 * inter) < 0) return -1;
        qm_silu_mul(qkv, 2 * inter, x, inter, T, inter);
        if (qm_gemm(&L->down, x, T, y, hidden) < 0) return -1;
        for (size_t i = 0; i < (size_t)T * hidden; i++) h[i] += y[i];
    }
    return 0;
}

/* The pools of every layer: float32 C-contiguous [blocks, bs, n_kv, hd], all of one shape. */
static int take_pools(PyObject *list, const DecPlan *p, Py_buffer *b, int *held, float **ptrs, Py_ssize_t *shape) {
    if (!PyList_Check(list) || PyList_GET_SIZE(list) != p->n_layers) {
        PyErr_SetString(PyExc_ValueError, "decoder_run: one K and one V pool per layer");
        return -1;
    }
    for (int l = 0; l < p->n_layers; l++) {
        Py_buffer *pb = &b[*held];
        if (PyObject_GetBuffer(PyList_GET_ITEM(list, l), pb, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0)
            return -1;
        (*held)++;
        if (!qm_is_f32(pb) || pb->ndim != 4 || pb->shape[2] != p->n_kv || pb->shape[3] != p->hd ||
            (shape[0] && (pb->shape[0] != shape[0] || pb->shape[1] != shape[1]))) {
            PyErr_SetString(PyExc_ValueError, "decoder_run: a KV pool has the wrong shape or type");
            return -1;
        }
        shape[0] = pb->shape[0];
        shape[1] = pb->shape[1];
        ptrs[l] = (float *)pb->buf;
    }
    return 0;
}

/* decoder_run(plan, h, k_pools, v_pools, cos, sin, slots, block_tables, context_lens): every layer of
   the plan on the residual stream h float32 [T, hidden] (C-contiguous, updated in place); this
   step's K/V rows go to `slots` of each layer's pools; cos, sin [T, head_dim / 2]; block_tables
   int64 [T, max_blocks] and context_lens int64 [T] as for attention. */
PyObject *qm_py_decoder_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "decoder_run takes 9 arguments");
        return NULL;
    }
    const DecPlan *p = (const DecPlan *)PyCapsule_GetPointer(args[0], PLAN_NAME);
    if (!p) return NULL;
    const int n = p->n_layers;
    Py_buffer *b = (Py_buffer *)calloc(2 * (size_t)n + 6, sizeof(Py_buffer));
    float **pools = (float **)calloc(2 * (size_t)n + 1, sizeof(float *));
    int held = 0, err = 0;
    PyObject *result = NULL;
    Py_ssize_t shape[2] = {0, 0};
    if (!b || !pools) {
        PyErr_NoMemory();
        goto done;
    }
    PyObject *arrays[6] = {args[1], args[4], args[5], args[6], args[7], args[8]};
    for (int i = 0; i < 6; i++) {
        int flags = (i == 4 ? PyBUF_STRIDES : PyBUF_C_CONTIGUOUS) | PyBUF_FORMAT | (i == 0 ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(arrays[i], &b[held], flags) < 0) goto done;
        held++;
    }
    Py_buffer *h = &b[0], *c = &b[1], *s = &b[2], *sl = &b[3], *bt = &b[4], *cl = &b[5];
    const Py_ssize_t T = h->ndim == 2 ? h->shape[0] : -1;
    if (!qm_is_f32(h) || h->ndim != 2 || h->shape[1] != p->hidden || !qm_is_f32(c) || !qm_is_f32(s) ||
        c->len != T * p->hd / 2 * 4 || s->len != c->len || !qm_is_i64(sl) || sl->ndim != 1 || sl->shape[0] != T ||
        !qm_is_i64(bt) || bt->ndim != 2 || bt->shape[0] != T || (bt->shape[1] > 1 && bt->strides[1] != 8) ||
        bt->strides[0] % 8 || bt->strides[0] < 0 || !qm_is_i64(cl) || cl->ndim != 1 || cl->shape[0] != T) {
        PyErr_SetString(PyExc_ValueError, "decoder_run: bad shapes or types");
        goto done;
    }
    if (take_pools(args[2], p, b, &held, pools, shape) < 0 || take_pools(args[3], p, b, &held, pools + n, shape) < 0)
        goto done;
    const Py_ssize_t rows = shape[0] * shape[1];
    const int64_t *slots = (const int64_t *)sl->buf, *lens = (const int64_t *)cl->buf;
    for (Py_ssize_t t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= rows) {
            PyErr_Format(PyExc_ValueError, "decoder_run: row %zd's slot falls outside the pool", t);
            goto done;
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
                    run_layers(p, (float *)h->buf, (int)T, pools, pools + n, (int)shape[1], (const float *)c->buf,
                               (const float *)s->buf, slots, (const int64_t *)bt->buf, bt_row, lens) < 0);
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
