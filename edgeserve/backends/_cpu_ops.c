/* Fused CPU ops of a decoder block for edgeserve's NumPy backend: decode attention straight from
the paged KV pool, RMSNorm, rotate-half RoPE, SiLU-gated multiply and the KV pool's row writes.

Each Python entry point returns False, having done nothing, when its arrays have a layout it does
not take (dtype, strides, sizes), so the caller falls back to NumPy or numba instead of failing.

Decode attention. A work item is one sequence, one KV head, up to ATT_GROUP of the query heads
that share it, and a range of its keys: each K and V row is read once for the whole group. Keys
go by tiles of ATT_TILE: the tile's scores, then an online softmax (running max and sum per
head, the accumulator rescaled when the max grows), then the weighted sum of V rows. Keys are
cut into ranges of ATT_SPLIT whose partial results (max, sum, unnormalized output) are merged
afterwards, in order: one long context keeps every thread busy, and since the cut depends on the
row's own length only, a row's result is the same bits whatever else is in the batch (a prompt
gives the same answer alone, beside other requests, or after a prefix-cache hit). exp is a polynomial (Cephes' expf, ~1 ulp) that vectorizes: libm's expf per
score costs more than the dot product it follows.

Where a step has many decode rows, a row's item takes several of its KV heads and goes tile by tile
through all of them (the heads of a key lie side by side in the pool, so it reads whole blocks); each
head's arithmetic is the same as alone.

A prompt's consecutive rows (and a speculating sequence's guesses) read the same keys: up to ATT_BLOCK of
them make one item, which first copies its key range's K and V rows, as float32, into its thread's stage,
contiguous, then runs each row over the copy. A head's keys lie n_kv * head_dim apart in the pool (4 KiB
for 8 heads of 128): read in place by every row, they fell in a few cache sets and evicted each other,
and a 512-token prompt's attention ran at a tenth of the FMA rate. Each row's arithmetic is the one-row
kernel's, in the same order, so its bits do not depend on the rows beside it.

A pool holds float32, float16 or int8 heads (see QM_KV_* in _qmatmul.h). The kernels compute in
float32: a float32 tile is read in place, a float16 or int8 one is converted once into a float32
tile on the stack (in L1) and then serves all the item's query heads, so the pool is read at half
or a quarter of the bytes and the arithmetic is the float32 kernel's.

Code paths: AVX-512 intrinsics for the attention, where head_dim is a multiple of 32; portable C
elsewhere, written as lane loops that compilers vectorize (NEON included), and built a second
and third time inside AVX2 and AVX-512 target functions for the small ops on x86.
*/
#include "_qmatmul.h"
#include "_vmath.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ATT_TILE 64    /* keys per tile: a tile's scores stay in L1; a multiple of 16 (keys go by 4, masks by 16) */
#define ATT_GROUP 8    /* query heads per item at most (bounds the item's stack buffers) */
#define ATT_MAX_HD QM_MAX_HEAD_DIM
#define ATT_SPLIT 256  /* keys per range: shorter ones cost more in merging than they gain; a multiple of ATT_TILE */
#define ATT_BLOCK 16   /* rows of one prompt per item at most */
#define ATT_BLOCK_STATE (ATT_BLOCK * ATT_GROUP * (ATT_MAX_HD + ATT_TILE)) /* floats */
#define LANES 16
#define INLINE static inline __attribute__((always_inline))

#ifdef __FLT16_MAX__
#define HAVE_FLOAT16 1
typedef _Float16 half_t;
#endif

/* ---- decode attention ---- */

/* One row's share of an item, what the kernels run. */
typedef struct {
    int s, kv, h0, nh; /* row, KV head, its query heads h0..h0+nh-1 */
    int t0, t1;        /* keys */
    int slot;          /* partial result slot, or -1: the row writes out itself */
} AttItem;

/* A work item: rows s..s+nr-1 (consecutive rows of one prompt when nr > 1), KV head kv, query heads
   h0..h0+nh-1, key range k of each row; or one row (nr 1) and KV heads kv..kv+nkv-1 with their query
   heads (nkv > 1: heads that go tile by tile together, see att_rows_avx512). */
typedef struct {
    int s, nr, kv, h0, nh, k, nkv;
} AttBlock;

typedef struct {
    const float *q;
    const char *k, *v; /* pools of kv_type, addressed in bytes */
    const int64_t *bt;
    float *out, *part;
    float *stage;             /* per thread (qm_worker_index), 64-byte aligned: a block's K and V rows, 2 * ATT_SPLIT * hd
                                 floats, then its rows' accumulators and scores (ATT_BLOCK_STATE) */
    const AttBlock *items;
    const int64_t *lens;
    const int *slot_base;     /* a row's first partial slot (rows of one range have none) */
    Py_ssize_t q_row, bt_row; /* elements between rows of q and of block_tables */
    size_t head_bytes;        /* one KV head in the pool */
    int H, hd, bs, n_kv, slot_floats, kv_type, n_items;
    int sub, subs;            /* query heads per item at most; items per KV head and key range */
    int window; /* a row sees its last `window` keys only (sliding-window layers); 0: all of them */
    float scale;
} AttTask;

/* Pool offsets (in bytes) of keys t0..t0+nt-1 of the item's sequence and KV head: one division
   per tile, not per key. */
INLINE void tile_offsets(const AttTask *t, const AttItem *it, int t0, int nt, size_t *off) {
    const int64_t *table = t->bt + (size_t)it->s * t->bt_row;
    const size_t row = (size_t)t->n_kv * t->head_bytes;
    int b = t0 / t->bs, r = t0 % t->bs;
    size_t base = (size_t)table[b] * t->bs * row + (size_t)it->kv * t->head_bytes;
    for (int i = 0; i < nt; i++) {
        off[i] = base + (size_t)r * row;
        if (++r == t->bs && i + 1 < nt) {
            r = 0;
            base = (size_t)table[++b] * t->bs * row + (size_t)it->kv * t->head_bytes;
        }
    }
}

/* ---- KV heads in the pool's type ---- */

/* Values an int8 head's scale covers: 64 (head_dim a multiple of 64), else the whole head. */
INLINE int i8_group(int hd) { return hd % 64 ? hd : 64; }

size_t qm_kv_head_bytes(int kv_type, int hd) {
    return kv_type == QM_KV_F32   ? (size_t)hd * 4
           : kv_type == QM_KV_F16 ? (size_t)hd * 2
                                  : (size_t)hd + 2 * (size_t)(hd / i8_group(hd));
}

#ifdef HAVE_FLOAT16
/* Scale g of an int8 head. */
INLINE float i8_scale(const char *head, int hd, int g) {
    half_t s;
    memcpy(&s, head + hd + 2 * g, 2);
    return (float)s;
}
#endif

/* One head of the pool as hd floats (portable C; the AVX2 kernels' own version gives the same bits). */
static void kv_head_floats(const char *src, int kv_type, int hd, float *dst) {
#ifdef HAVE_FLOAT16
    if (kv_type == QM_KV_I8) {
        const int G = i8_group(hd);
        for (int i = 0; i < hd; i++) dst[i] = (float)((const int8_t *)src)[i] * i8_scale(src, hd, i / G);
        return;
    }
    if (kv_type == QM_KV_F16) {
        for (int i = 0; i < hd; i++) dst[i] = (float)((const half_t *)src)[i];
        return;
    }
#endif
    memcpy(dst, src, sizeof(float) * hd);
}

/* hd floats into one head of the pool's type: float16 rounded to nearest even; int8 by a scale per
   group of i8_group values, s = max|x| / 127 (as float16, stored after the values), x / s rounded to
   nearest even. */
static void kv_head_store(char *dst, int kv_type, const float *x, int hd) {
#ifdef HAVE_FLOAT16
    if (kv_type == QM_KV_I8) {
        const int G = i8_group(hd);
        for (int g = 0; g < hd / G; g++) {
            float amax = 0.f;
            for (int i = g * G; i < (g + 1) * G; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
            const half_t s = (half_t)(amax / 127.f);
            const float inv = (float)s > 0.f ? 1.f / (float)s : 0.f;
            for (int i = g * G; i < (g + 1) * G; i++) {
                const float q = rintf(x[i] * inv);
                ((int8_t *)dst)[i] = (int8_t)(q > 127.f ? 127.f : q < -127.f ? -127.f : q);
            }
            memcpy(dst + hd + 2 * g, &s, 2);
        }
        return;
    }
    if (kv_type == QM_KV_F16) {
        for (int i = 0; i < hd; i++) ((half_t *)dst)[i] = (half_t)x[i];
        return;
    }
#endif
    memcpy(dst, x, sizeof(float) * hd);
}

PyObject *qm_kv_type_names(void) {
#ifdef HAVE_FLOAT16
    return Py_BuildValue("(sss)", "float32", "float16", "int8");
#else
    return Py_BuildValue("(s)", "float32");
#endif
}

int qm_kv_type(const Py_buffer *b, Py_ssize_t hd) {
    if (b->ndim != 4 || !b->format) return -1;
    const char *f = b->format;
    if (*f == '<' || *f == '=' || *f == '@') f++;
    if (qm_is_f32(b) && b->shape[3] == hd) return QM_KV_F32;
#ifdef HAVE_FLOAT16
    if (b->itemsize == 2 && !strcmp(f, "e") && b->shape[3] == hd) return QM_KV_F16;
    if (b->itemsize == 1 && !strcmp(f, "b") && (size_t)b->shape[3] == qm_kv_head_bytes(QM_KV_I8, (int)hd)) return QM_KV_I8;
#endif
    return -1;
}

/* A tile's K and V rows as float32: in the pool itself (float32), else converted by `convert` into
   kbuf and vbuf [ATT_TILE, hd]. Rows nt.. up to a multiple of 4 repeat the last (scored, then ignored). */
INLINE void tile_rows(const AttTask *t, const size_t *off, int nt, const float **kr, const float **vr, float *kbuf,
                      float *vbuf, void (*convert)(const char *, int, int, float *)) {
    for (int i = 0; i < nt; i++) {
        if (t->kv_type == QM_KV_F32) {
            kr[i] = (const float *)(t->k + off[i]);
            vr[i] = (const float *)(t->v + off[i]);
        } else {
            convert(t->k + off[i], t->kv_type, t->hd, kbuf + (size_t)i * t->hd);
            convert(t->v + off[i], t->kv_type, t->hd, vbuf + (size_t)i * t->hd);
            kr[i] = kbuf + (size_t)i * t->hd;
            vr[i] = vbuf + (size_t)i * t->hd;
        }
    }
    for (int i = nt; i < ((nt + 3) & ~3); i++) kr[i] = kr[nt - 1];
}

/* A row's first key: where its window starts (so the cut into ranges depends on the row alone), else 0. */
INLINE int64_t att_first(const AttTask *t, int64_t len) { return t->window > 0 && len > t->window ? len - t->window : 0; }

/* The key ranges of a row of `len` keys. */
INLINE int att_ranges(const AttTask *t, int64_t len) { return (int)((len - att_first(t, len) + ATT_SPLIT - 1) / ATT_SPLIT); }

/* This thread's stage. */
INLINE float *att_stage(const AttTask *t) {
    return t->stage + (size_t)qm_worker_index() * (2 * ATT_SPLIT * (size_t)t->hd + ATT_BLOCK_STATE);
}

/* Row s's share of item b into it; 0 when the row has no keys in the item's range. */
INLINE int row_item(const AttTask *t, const AttBlock *b, int s, AttItem *it) {
    const int64_t len = t->lens[s], first = att_first(t, len), t0 = first + (int64_t)b->k * ATT_SPLIT;
    const int ns = att_ranges(t, len);
    if (b->k >= ns) return 0;
    it->s = s;
    it->kv = b->kv;
    it->h0 = b->h0;
    it->nh = b->nh;
    it->t0 = (int)t0;
    it->t1 = (int)(t0 + ATT_SPLIT < len ? t0 + ATT_SPLIT : len);
    /* slots go by the row's head groups, then its ranges */
    const int hg = b->kv * t->subs + (b->h0 - b->kv * (t->H / t->n_kv)) / t->sub;
    it->slot = ns > 1 ? t->slot_base[s] + hg * ns + b->k : -1;
    return 1;
}

/* A one-row item's shares of its KV heads (b->nkv of them, in head order) that have keys in its range, into rows;
   returns how many. */
INLINE int head_rows(const AttTask *t, const AttBlock *b, AttItem *rows) {
    int nr = 0;
    for (int j = 0; j < b->nkv; j++) {
        AttBlock head = *b;
        head.kv += j;
        head.h0 += j * (t->H / t->n_kv);
        nr += row_item(t, &head, b->s, &rows[nr]);
    }
    return nr;
}

/* Item `index`'s rows that have keys in its range, into rows (returns how many: a suffix of the item's rows,
   which are one key longer each); for an item of several rows, their K and V rows of the range (the last row's,
   which holds the others' keys) copied into this thread's stage as float32 (by `convert` from float16 or int8).
   *sk stays NULL for a one-row item, which reads the pool in place; one of several KV heads gives a row's
   share per head, in head order. */
INLINE int block_rows(const AttTask *t, int index, void (*convert)(const char *, int, int, float *), AttItem *rows,
                      const float **sk, const float **sv, int *st0) {
    const AttBlock *b = &t->items[index];
    int nr = 0;
    *sk = *sv = NULL;
    *st0 = 0;
    if (b->nkv > 1) return head_rows(t, b, rows);
    for (int s = b->s; s < b->s + b->nr; s++) nr += row_item(t, b, s, &rows[nr]);
    if (b->nr < 2 || nr == 0) return nr;
    const AttItem last = rows[nr - 1];
    float *k = att_stage(t), *v = k + (size_t)ATT_SPLIT * t->hd;
    size_t off[ATT_SPLIT];
    const int n = last.t1 - last.t0;
    tile_offsets(t, &last, last.t0, n, off);
    for (int i = 0; i < n; i++) {
        if (t->kv_type != QM_KV_F32) {
            convert(t->k + off[i], t->kv_type, t->hd, k + (size_t)i * t->hd);
            convert(t->v + off[i], t->kv_type, t->hd, v + (size_t)i * t->hd);
        } else {
            memcpy(k + (size_t)i * t->hd, t->k + off[i], sizeof(float) * t->hd);
            memcpy(v + (size_t)i * t->hd, t->v + off[i], sizeof(float) * t->hd);
        }
    }
    *sk = k;
    *sv = v;
    *st0 = last.t0;
    return nr;
}

/* A tile's rows in a stage: rows i0..i0+nt-1 of sk and sv; rows nt.. up to a multiple of 4 repeat the last. */
INLINE void staged_rows(const float *sk, const float *sv, int i0, int nt, int hd, const float **kr, const float **vr) {
    for (int i = 0; i < nt; i++) {
        kr[i] = sk + (size_t)(i0 + i) * hd;
        vr[i] = sv + (size_t)(i0 + i) * hd;
    }
    for (int i = nt; i < ((nt + 3) & ~3); i++) kr[i] = kr[nt - 1];
}

/* The rows of a staged item as they go tile by tile: accumulators and scores in the thread's stage (64-byte
   aligned, ATT_BLOCK_STATE floats), each head's running max and sum, and its accumulator's factor at this tile. */
typedef struct {
    float (*acc)[ATT_GROUP][ATT_MAX_HD];
    float (*sc)[ATT_GROUP][ATT_TILE];
    float m[ATT_BLOCK][ATT_GROUP], l[ATT_BLOCK][ATT_GROUP], alpha[ATT_BLOCK][ATT_GROUP];
} BlockState;

INLINE void block_start(BlockState *b, float *state, int nr, int nh, int hd) {
    b->acc = (float(*)[ATT_GROUP][ATT_MAX_HD])state;
    b->sc = (float(*)[ATT_GROUP][ATT_TILE])(state + ATT_BLOCK * ATT_GROUP * ATT_MAX_HD);
    for (int r = 0; r < nr; r++)
        for (int g = 0; g < nh; g++) {
            memset(b->acc[r][g], 0, sizeof(float) * hd);
            b->m[r][g] = -INFINITY;
            b->l[r][g] = 0.f;
        }
}

/* A row's keys in the tile from t0 (none or fewer past its last). */
INLINE int tile_keys(const AttItem *row, int t0) { return row->t1 - t0 < ATT_TILE ? row->t1 - t0 : ATT_TILE; }

/* The item's result: normalized into out, or (acc, max, sum) into its slot for merging. */
static void att_finish(const AttTask *t, const AttItem *it, float (*acc)[ATT_MAX_HD], const float *m, const float *l) {
    const int hd = t->hd;
    for (int g = 0; g < it->nh; g++) {
        if (it->slot < 0) {
            float *o = t->out + ((size_t)it->s * t->H + it->h0 + g) * hd;
            float inv = 1.f / l[g];
            for (int i = 0; i < hd; i++) o[i] = acc[g][i] * inv;
        } else {
            float *p = t->part + (size_t)it->slot * t->slot_floats;
            memcpy(p + (size_t)g * hd, acc[g], sizeof(float) * hd);
            p[ATT_GROUP * hd + g] = m[g];
            p[ATT_GROUP * hd + ATT_GROUP + g] = l[g];
        }
    }
}

/* The portable kernel's vectors: GCC and clang's generic vectors of 8 floats, one AVX register,
   two SSE or NEON ones. Plain loops with 8 partial sums get vectorized poorly (gcc deinterleaves
   them with shuffles), and a running scalar sum chains its adds. Accessed through an unaligned,
   may_alias type, and never passed to functions: a vector argument's ABI depends on the target. */
typedef float v8f __attribute__((vector_size(32)));
typedef float v8f_u __attribute__((vector_size(32), aligned(4), may_alias));
#define LOAD8(p) (*(const v8f_u *)(p))
#define STORE8(p, v) (*(v8f_u *)(p) = (v))

/* a macro on the variable: a function would take its address, and gcc then keeps it in memory */
#define HSUM8(v) ((((v)[0] + (v)[4]) + ((v)[1] + (v)[5])) + (((v)[2] + (v)[6]) + ((v)[3] + (v)[7])))

/* Four keys' scores at once: four independent chains of adds instead of one. */
INLINE void dot4_portable(const float *q, const float *k0, const float *k1, const float *k2, const float *k3, int n,
                          float *out) {
    v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const v8f x = LOAD8(q + i);
        a0 += x * LOAD8(k0 + i);
        a1 += x * LOAD8(k1 + i);
        a2 += x * LOAD8(k2 + i);
        a3 += x * LOAD8(k3 + i);
    }
    out[0] = HSUM8(a0);
    out[1] = HSUM8(a1);
    out[2] = HSUM8(a2);
    out[3] = HSUM8(a3);
    for (; i < n; i++) {
        out[0] += q[i] * k0[i];
        out[1] += q[i] * k1[i];
        out[2] += q[i] * k2[i];
        out[3] += q[i] * k3[i];
    }
}

INLINE float sum_portable(const float *x, int n) {
    v8f acc = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8) acc += LOAD8(x + i);
    float s = HSUM8(acc);
    for (; i < n; i++) s += x[i];
    return s;
}

/* One row's keys of its range: from the pool, or from its item's stage (sk, sv holding keys st0..). */
INLINE void att_row_portable(const AttTask *t, const AttItem *it, const float *sk, const float *sv, int st0) {
    const int hd = t->hd, nh = it->nh;
    float qs[ATT_GROUP][ATT_MAX_HD], acc[ATT_GROUP][ATT_MAX_HD], sc[ATT_GROUP][ATT_TILE], m[ATT_GROUP], l[ATT_GROUP];
    size_t off[ATT_TILE];
    const float *kr[ATT_TILE], *vr[ATT_TILE];
    float kbuf[t->kv_type == QM_KV_F32 ? 1 : ATT_TILE * hd], vbuf[t->kv_type == QM_KV_F32 ? 1 : ATT_TILE * hd];
    for (int g = 0; g < nh; g++) {
        const float *qr = t->q + (size_t)it->s * t->q_row + (size_t)(it->h0 + g) * hd;
        for (int i = 0; i < hd; i++) {
            qs[g][i] = qr[i] * t->scale;
            acc[g][i] = 0.f;
        }
        m[g] = -INFINITY;
        l[g] = 0.f;
    }
    for (int t0 = it->t0; t0 < it->t1; t0 += ATT_TILE) {
        int nt = it->t1 - t0 < ATT_TILE ? it->t1 - t0 : ATT_TILE;
        if (sk) {
            staged_rows(sk, sv, t0 - st0, nt, hd, kr, vr);
        } else {
            tile_offsets(t, it, t0, nt, off);
            tile_rows(t, off, nt, kr, vr, kbuf, vbuf, kv_head_floats);
        }
        for (int g = 0; g < nh; g++) {
            for (int i = 0; i < nt; i += 4) dot4_portable(qs[g], kr[i], kr[i + 1], kr[i + 2], kr[i + 3], hd, sc[g] + i);
            /* max, exp and sum as separate loops: a float reduction inside the exp loop would
               keep the compiler from vectorizing it */
            float top = m[g];
            for (int i = 0; i < nt; i++) top = sc[g][i] > top ? sc[g][i] : top;
            for (int i = 0; i < nt; i++) sc[g][i] = exp_poly(sc[g][i] - top);
            float alpha = exp_poly(m[g] - top);
            m[g] = top;
            l[g] = l[g] * alpha + sum_portable(sc[g], nt);
            for (int j = 0; j < hd; j++) acc[g][j] *= alpha;
            /* four V rows per pass over the accumulator, which lives in memory here */
            const int hd8 = hd & ~7;
            int i = 0;
            for (; i + 4 <= nt; i += 4) {
                const float *v0 = vr[i], *v1 = vr[i + 1], *v2 = vr[i + 2], *v3 = vr[i + 3];
                const float p0 = sc[g][i], p1 = sc[g][i + 1], p2 = sc[g][i + 2], p3 = sc[g][i + 3];
                for (int j = 0; j < hd8; j += 8)
                    STORE8(acc[g] + j, LOAD8(acc[g] + j) + ((p0 * LOAD8(v0 + j) + p1 * LOAD8(v1 + j)) +
                                                            (p2 * LOAD8(v2 + j) + p3 * LOAD8(v3 + j))));
                for (int j = hd8; j < hd; j++) acc[g][j] += (p0 * v0[j] + p1 * v1[j]) + (p2 * v2[j] + p3 * v3[j]);
            }
            for (; i < nt; i++) {
                const float p = sc[g][i];
                for (int j = 0; j < hd; j++) acc[g][j] += p * vr[i][j];
            }
        }
    }
    att_finish(t, it, acc, m, l);
}

/* Item `index`: its stage (several rows), then each of its rows with keys in its range. */
static void att_item_generic(const void *ctx, int index) {
    const AttTask *t = (const AttTask *)ctx;
    const float *sk, *sv;
    int st0;
    AttItem rows[ATT_BLOCK];
    const int nr = block_rows(t, index, kv_head_floats, rows, &sk, &sv, &st0);
    for (int r = 0; r < nr; r++) att_row_portable(t, &rows[r], sk, sv, st0);
}

#ifdef QM_X86
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c")))

#define AVX2_OPS __attribute__((target("avx2,fma,f16c")))

/* kv_head_floats for hd a multiple of 8, by F16C and AVX2: the same bits. */
static AVX2_OPS void kv_head_floats_avx2(const char *src, int kv_type, int hd, float *dst) {
    if (kv_type == QM_KV_I8) {
        const int G = i8_group(hd);
        for (int g = 0; g < hd / G; g++) {
            uint16_t s;
            memcpy(&s, src + hd + 2 * g, 2);
            const __m256 sv = _mm256_set1_ps(_cvtsh_ss(s));
            for (int j = g * G; j < (g + 1) * G; j += 8) {
                const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(src + j)));
                _mm256_storeu_ps(dst + j, _mm256_mul_ps(_mm256_cvtepi32_ps(q), sv));
            }
        }
    } else {
        for (int j = 0; j < hd; j += 8)
            _mm256_storeu_ps(dst + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + 2 * j))));
    }
}

/* kv_head_store for a float16 head, hd a multiple of 8, by F16C: the same bits (round to nearest even), where
   the portable C's conversion is a libgcc call per value (gcc without F16C): 5% of a 16-stream step's time. */
static AVX2_OPS void kv_head_store_f16c(char *dst, const float *x, int hd) {
    for (int j = 0; j < hd; j += 8)
        _mm_storeu_si128((__m128i *)(dst + 2 * j), _mm256_cvtps_ph(_mm256_loadu_ps(x + j), _MM_FROUND_TO_NEAREST_INT));
}

/* The next tile's rows, fetched while this one computes (the pool is read from DRAM: a step's K/V
   outgrow the caches, and the weights stream through them). */
INLINE void prefetch_rows(const AttTask *t, const size_t *next, int r0, int r1) {
    for (int r = r0; r < r1; r++)
        for (size_t b = 0; b < t->head_bytes; b += 64) {
            _mm_prefetch(t->k + next[r] + b, _MM_HINT_T1);
            _mm_prefetch(t->v + next[r] + b, _MM_HINT_T1);
        }
}

/* The first keys of the item after this one, which the pool most likely hands the same thread (it claims
   items in order): fetched while this one computes, since its own first tile has no tile before it. */
INLINE void prefetch_next_item(const AttTask *t, int index) {
    AttItem it;
    if (index + 1 >= t->n_items || !row_item(t, &t->items[index + 1], t->items[index + 1].s, &it)) return;
    const int n = it.t1 - it.t0 < ATT_TILE ? it.t1 - it.t0 : ATT_TILE;
    size_t off[ATT_TILE];
    tile_offsets(t, &it, it.t0, n, off);
    prefetch_rows(t, off, 0, n);
}

static inline AVX2_OPS __attribute__((always_inline)) float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* Four keys' scores: q (already scaled) against rows k0..k3 of 8 * HV floats, two partial sums a key
   so that eight FMA chains run side by side. */
static inline AVX2_OPS __attribute__((always_inline)) __m128 dot4_avx2(const float *q, const float *k0, const float *k1,
                                                                     const float *k2, const float *k3, const int HV) {
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    for (int j = 0; j < HV; j += 2)
        for (int h = 0; h < 2 && j + h < HV; h++) {
            const __m256 x = _mm256_load_ps(q + 8 * (j + h));
            a[h] = _mm256_fmadd_ps(x, _mm256_loadu_ps(k0 + 8 * (j + h)), a[h]);
            a[2 + h] = _mm256_fmadd_ps(x, _mm256_loadu_ps(k1 + 8 * (j + h)), a[2 + h]);
            a[4 + h] = _mm256_fmadd_ps(x, _mm256_loadu_ps(k2 + 8 * (j + h)), a[4 + h]);
            a[6 + h] = _mm256_fmadd_ps(x, _mm256_loadu_ps(k3 + 8 * (j + h)), a[6 + h]);
        }
    const __m256 ab = _mm256_hadd_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]));
    const __m256 cd = _mm256_hadd_ps(_mm256_add_ps(a[4], a[5]), _mm256_add_ps(a[6], a[7]));
    const __m256 abcd = _mm256_hadd_ps(ab, cd);
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

/* softmax_tile512 on 8 lanes (the same sums in the AVX2 kernel's own order). */
static inline AVX2_OPS __attribute__((always_inline)) float softmax_tile256(float *sc, int nt, float *m, float *l) {
    const int n8 = nt & ~7;
    __m256 top = _mm256_set1_ps(*m);
    for (int i = 0; i < n8; i += 8) top = _mm256_max_ps(top, _mm256_load_ps(sc + i));
    __m128 t4 = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    t4 = _mm_max_ps(t4, _mm_movehl_ps(t4, t4));
    float mx = _mm_cvtss_f32(_mm_max_ss(t4, _mm_movehdup_ps(t4)));
    for (int i = n8; i < nt; i++) mx = sc[i] > mx ? sc[i] : mx;
    const __m256 mv = _mm256_set1_ps(mx);
    __m256 sum = _mm256_setzero_ps();
    for (int i = 0; i < n8; i += 8) {
        const __m256 p = exp256(_mm256_sub_ps(_mm256_load_ps(sc + i), mv));
        _mm256_store_ps(sc + i, p);
        sum = _mm256_add_ps(sum, p);
    }
    float total = hsum256(sum);
    for (int i = n8; i < nt; i++) total += sc[i] = exp_poly(sc[i] - mx);
    const float alpha = exp_poly(*m - mx);
    *m = mx;
    *l = *l * alpha + total;
    return alpha;
}

/* Query head h of row s, scaled, into qs (8 * HV floats, 32-byte aligned). */
static inline AVX2_OPS __attribute__((always_inline)) void scaled_q256(const AttTask *t, int s, int h, const int HV,
                                                                     float *qs) {
    const float *qr = t->q + (size_t)s * t->q_row + (size_t)h * 8 * HV;
    for (int j = 0; j < HV; j++)
        _mm256_store_ps(qs + 8 * j, _mm256_mul_ps(_mm256_loadu_ps(qr + 8 * j), _mm256_set1_ps(t->scale)));
}

/* acc = alpha acc + sum_i sc[i] V[i] for one head, 64 dims of the accumulator in registers at a time. */
static inline AVX2_OPS __attribute__((always_inline)) void
weighted_v256(float *acc, const float *sc, float alpha, const float *const *vr, int nt, const int HV) {
    const __m256 al = _mm256_set1_ps(alpha);
    for (int j0 = 0; j0 < HV; j0 += 8) {
        __m256 a[8];
        for (int j = 0; j < 8; j++) a[j] = _mm256_mul_ps(_mm256_load_ps(acc + 8 * (j0 + j)), al);
        for (int i = 0; i < nt; i++) {
            const float *vi = vr[i] + 8 * j0;
            const __m256 p = _mm256_broadcast_ss(sc + i);
            for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vi + 8 * j), a[j]);
        }
        for (int j = 0; j < 8; j++) _mm256_store_ps(acc + 8 * (j0 + j), a[j]);
    }
}

/* The AVX-512 kernel's plan on 8 lanes, head_dim = 8 * HV (HV a multiple of 8): q in memory (each of
   its vectors serves four keys), the output accumulated 64 dims at a time in registers; about a
   quarter faster than the portable kernel built for AVX2 on a 64-stream decode's pool reads. One row
   read from the pool in place. */
static inline AVX2_OPS __attribute__((always_inline)) void att_row_avx2(const AttTask *t, const AttItem *it, const int HV) {
    const int hd = 8 * HV, nh = it->nh;
    float qs[ATT_GROUP][ATT_MAX_HD] __attribute__((aligned(32)));
    float acc[ATT_GROUP][ATT_MAX_HD] __attribute__((aligned(32)));
    float sc[ATT_GROUP][ATT_TILE] __attribute__((aligned(32)));
    float m[ATT_GROUP], l[ATT_GROUP];
    size_t offs[2][ATT_TILE];
    const float *kr[ATT_TILE], *vr[ATT_TILE];
    float kbuf[t->kv_type == QM_KV_F32 ? 1 : ATT_TILE * hd], vbuf[t->kv_type == QM_KV_F32 ? 1 : ATT_TILE * hd];
    for (int g = 0; g < nh; g++) {
        scaled_q256(t, it->s, it->h0 + g, HV, qs[g]);
        memset(acc[g], 0, sizeof(float) * hd);
        m[g] = -INFINITY;
        l[g] = 0.f;
    }
    int nt = it->t1 - it->t0 < ATT_TILE ? it->t1 - it->t0 : ATT_TILE;
    tile_offsets(t, it, it->t0, nt, offs[0]);
    for (int t0 = it->t0, cur = 0; t0 < it->t1; t0 += ATT_TILE, cur ^= 1) {
        const size_t *off = offs[cur];
        const size_t *next = offs[cur ^ 1];
        const int n_next = it->t1 - t0 - nt < ATT_TILE ? it->t1 - t0 - nt : ATT_TILE;
        if (n_next > 0) tile_offsets(t, it, t0 + nt, n_next, offs[cur ^ 1]);
        tile_rows(t, off, nt, kr, vr, kbuf, vbuf, kv_head_floats_avx2);
        for (int g = 0; g < nh; g++) {
            for (int i = 0; i < nt; i += 4) {
                if (g == 0) prefetch_rows(t, next, i, i + 4 < n_next ? i + 4 : n_next);
                _mm_store_ps(sc[g] + i, dot4_avx2(qs[g], kr[i], kr[i + 1], kr[i + 2], kr[i + 3], HV));
            }
            weighted_v256(acc[g], sc[g], softmax_tile256(sc[g], nt, &m[g], &l[g]), vr, nt, HV);
        }
        nt = n_next;
    }
    att_finish(t, it, acc, m, l);
}

/* att_block_avx512's plan on 8 lanes: a staged item's rows tile by tile, each row's arithmetic att_row_avx2's. */
static inline AVX2_OPS __attribute__((always_inline)) void
att_block_avx2(const AttTask *t, const AttItem *rows, int nr, const int HV, const float *sk, const float *sv, int st0,
               float *state) {
    const int hd = 8 * HV, nh = rows[0].nh;
    BlockState b;
    float qs[ATT_MAX_HD] __attribute__((aligned(32)));
    const float *kr[ATT_TILE], *vr[ATT_TILE];
    block_start(&b, state, nr, nh, hd);
    for (int t0 = st0; t0 < rows[nr - 1].t1; t0 += ATT_TILE) {
        for (int r = 0; r < nr; r++) {
            const int nt = tile_keys(&rows[r], t0);
            if (nt <= 0) continue;
            staged_rows(sk, sv, t0 - st0, nt, hd, kr, vr);
            for (int g = 0; g < nh; g++) {
                scaled_q256(t, rows[r].s, rows[r].h0 + g, HV, qs);
                for (int i = 0; i < nt; i += 4)
                    _mm_store_ps(b.sc[r][g] + i, dot4_avx2(qs, kr[i], kr[i + 1], kr[i + 2], kr[i + 3], HV));
                b.alpha[r][g] = softmax_tile256(b.sc[r][g], nt, &b.m[r][g], &b.l[r][g]);
            }
        }
        for (int r = 0; r < nr; r++) {
            const int nt = tile_keys(&rows[r], t0);
            if (nt <= 0) continue;
            staged_rows(sk, sv, t0 - st0, nt, hd, kr, vr);
            for (int g = 0; g < nh; g++) weighted_v256(b.acc[r][g], b.sc[r][g], b.alpha[r][g], vr, nt, HV);
        }
    }
    for (int r = 0; r < nr; r++) att_finish(t, &rows[r], b.acc[r], b.m[r], b.l[r]);
}

static AVX2_OPS void att_item_avx2(const void *ctx, int index) {
    const AttTask *t = (const AttTask *)ctx;
    const float *sk, *sv;
    int st0;
    AttItem rows[ATT_BLOCK];
    prefetch_next_item(t, index);
    const int nr = block_rows(t, index, kv_head_floats_avx2, rows, &sk, &sv, &st0);
    float *state = att_stage(t) + 2 * ATT_SPLIT * (size_t)t->hd;
    if (t->hd != 64 && t->hd != 128 && t->hd != 256) {
        for (int r = 0; r < nr; r++) att_row_portable(t, &rows[r], sk, sv, st0);
        return;
    }
    for (int r = 0; r < nr && !sk; r++) {
        switch (t->hd) {
        case 64: att_row_avx2(t, &rows[r], 8); break;
        case 128: att_row_avx2(t, &rows[r], 16); break;
        default: att_row_avx2(t, &rows[r], 32); break;
        }
    }
    if (nr == 0 || !sk) return;
    switch (t->hd) {
    case 64: att_block_avx2(t, rows, nr, 8, sk, sv, st0, state); break;
    case 128: att_block_avx2(t, rows, nr, 16, sk, sv, st0, state); break;
    default: att_block_avx2(t, rows, nr, 32, sk, sv, st0, state); break;
    }
}

/* kv_head_floats for hd a multiple of 16 (the AVX-512 attention's), float16 heads sixteen values an instruction and
   inlined into its callers; the same bits. Converting head by head through the AVX2 version, a call per head for
   K and one for V, took a third of a one-row decode's attention time. */
static inline AVX512_TARGET __attribute__((always_inline)) void kv_head_floats_avx512(const char *src, int kv_type,
                                                                                     int hd, float *dst) {
    if (kv_type != QM_KV_F16) {
        kv_head_floats_avx2(src, kv_type, hd, dst);
        return;
    }
    for (int j = 0; j < hd; j += 16)
        _mm512_storeu_ps(dst + j, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + 2 * j))));
}

/* The horizontal sums of four vectors, as the four lanes of one: 11 shuffles and adds where four
   separate reductions take 16, and the dot products feed it with no dependency between them. */
static inline AVX512_TARGET __attribute__((always_inline)) __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    __m512 abcd = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
                                _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
    abcd = _mm512_add_ps(abcd, _mm512_shuffle_f32x4(abcd, abcd, 0x4e));
    abcd = _mm512_add_ps(abcd, _mm512_shuffle_f32x4(abcd, abcd, 0xb1));
    return _mm512_castps512_ps128(abcd);
}

static inline AVX512_TARGET __attribute__((always_inline)) __m512 dot_vec(const __m512 *q, const float *k, const int HV) {
    __m512 d0 = _mm512_mul_ps(q[0], _mm512_loadu_ps(k)), d1 = _mm512_mul_ps(q[1], _mm512_loadu_ps(k + 16));
    for (int j = 2; j < HV; j += 2) {
        d0 = _mm512_fmadd_ps(q[j], _mm512_loadu_ps(k + 16 * j), d0);
        if (j + 1 < HV) d1 = _mm512_fmadd_ps(q[j + 1], _mm512_loadu_ps(k + 16 * j + 16), d1);
    }
    return _mm512_add_ps(d0, d1);
}

/* acc[g] = alpha[g] acc[g] + sum_i sc[g][i] V[i] for heads g0..g0+GN-1 (GN * HV <= 16): the sums of
   all GN heads in registers, so each V row is loaded once for them, with GN * HV independent chains. */
static inline AVX512_TARGET __attribute__((always_inline)) void
att_weighted_v512(float (*acc)[ATT_MAX_HD], float (*sc)[ATT_TILE], const float *alpha, const float *const *vr, int nt,
                  int g0, const int GN, const int HV) {
    __m512 a[16];
    for (int g = 0; g < GN; g++) {
        const __m512 al = _mm512_set1_ps(alpha[g0 + g]);
        for (int j = 0; j < HV; j++) a[g * HV + j] = _mm512_mul_ps(_mm512_load_ps(acc[g0 + g] + 16 * j), al);
    }
    for (int i = 0; i < nt; i++)
        for (int j = 0; j < HV; j++) {
            const __m512 v = _mm512_loadu_ps(vr[i] + 16 * j);
            for (int g = 0; g < GN; g++)
                a[g * HV + j] = _mm512_fmadd_ps(_mm512_set1_ps(sc[g0 + g][i]), v, a[g * HV + j]);
        }
    for (int g = 0; g < GN; g++)
        for (int j = 0; j < HV; j++) _mm512_store_ps(acc[g0 + g] + 16 * j, a[g * HV + j]);
}

/* The online softmax over a tile's scores sc[0..nt) of one head: their exponentials in place, its running
   max m and sum l updated; returns the factor for its accumulator. */
static inline AVX512_TARGET __attribute__((always_inline)) float softmax_tile512(float *sc, int nt, float *m, float *l) {
    __m512 top = _mm512_set1_ps(*m);
    for (int i = 0; i < nt; i += 16) {
        __mmask16 k = nt - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (nt - i)) - 1);
        top = _mm512_mask_max_ps(top, k, top, _mm512_loadu_ps(sc + i));
    }
    const float mx = _mm512_reduce_max_ps(top);
    const __m512 mv = _mm512_set1_ps(mx);
    __m512 sum = _mm512_setzero_ps();
    for (int i = 0; i < nt; i += 16) {
        __mmask16 k = nt - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (nt - i)) - 1);
        __m512 p = _mm512_maskz_mov_ps(k, exp512(_mm512_sub_ps(_mm512_loadu_ps(sc + i), mv)));
        _mm512_storeu_ps(sc + i, p);
        sum = _mm512_add_ps(sum, p);
    }
    const float alpha = exp_poly(*m - mx);
    *m = mx;
    *l = *l * alpha + _mm512_reduce_add_ps(sum);
    return alpha;
}

/* Query head q (scaled, head_dim = 16 * HV) against keys kr[i..i+3]: their four scores into sc + i. */
static inline AVX512_TARGET __attribute__((always_inline)) void
scores4_512(const __m512 *q, const float *const *kr, int i, const int HV, float *sc) {
    _mm_storeu_ps(sc + i, hsum4(dot_vec(q, kr[i], HV), dot_vec(q, kr[i + 1], HV), dot_vec(q, kr[i + 2], HV),
                                dot_vec(q, kr[i + 3], HV)));
}

/* Query head h of row s, scaled, into q. */
static inline AVX512_TARGET __attribute__((always_inline)) void
scaled_q512(const AttTask *t, int s, int h, const int HV, __m512 *q) {
    const float *qr = t->q + (size_t)s * t->q_row + (size_t)h * 16 * HV;
    for (int j = 0; j < HV; j++) q[j] = _mm512_mul_ps(_mm512_loadu_ps(qr + 16 * j), _mm512_set1_ps(t->scale));
}

/* The weighted V rows of a tile for heads 0..nh-1, VH heads at a time (each V row read once for them: it was
   read once per head, and the loads bound a prompt's attention). */
static inline AVX512_TARGET __attribute__((always_inline)) void
weighted_v_tile512(float (*acc)[ATT_MAX_HD], float (*sc)[ATT_TILE], const float *alpha, const float *const *vr, int nt,
                   int nh, const int HV) {
    const int VH = HV >= 16 ? 1 : 16 / HV; /* heads whose V sums fit 16 registers */
    int g = 0;
    for (; g + VH <= nh; g += VH) att_weighted_v512(acc, sc, alpha, vr, nt, g, VH, HV);
    for (; g < nh; g++) att_weighted_v512(acc, sc, alpha, vr, nt, g, 1, HV);
}

/* One row read from the pool in place (a decode row), head_dim = 16 * HV (HV >= 2; a constant where inlined):
   its shares its[0..n) of one or more KV heads, tile by tile, every head's tile before the next tile. A key's
   heads lie side by side in the pool, so the heads of a tile read whole blocks of it, where head after head
   read 256 bytes of every 2 KiB twice as slow (64 decode rows at 192 keys). A KV head's query heads score
   four keys each before the next four, so those keys are read while in L1 (head by head over the whole tile:
   15-28% slower). Each head's next tile is fetched while its current one computes; in the item's last tile that
   is the next item's first (after[0..n_after): its shares, which the pool most likely hands this thread next), so
   an item starts with its keys on their way, where it used to start with one head's first tile fetched. Each
   head's arithmetic is the same whatever the heads beside it. state: ATT_BLOCK_STATE floats, 64-byte aligned. */
static inline AVX512_TARGET __attribute__((always_inline)) void
att_rows_avx512(const AttTask *t, const AttItem *its, int n, const AttItem *after, int n_after, const int HV,
                float *state) {
    const int hd = 16 * HV, nh = its[0].nh;
    BlockState b;
    size_t off[ATT_TILE], next[ATT_TILE];
    const float *kr[ATT_TILE], *vr[ATT_TILE];
    float kbuf[t->kv_type == QM_KV_F32 ? 1 : ATT_TILE * hd], vbuf[t->kv_type == QM_KV_F32 ? 1 : ATT_TILE * hd];
    block_start(&b, state, n, nh, hd);
    for (int t0 = its[0].t0; t0 < its[0].t1; t0 += ATT_TILE) {
        const int nt = tile_keys(&its[0], t0), last = t0 + nt >= its[0].t1;
        for (int j = 0; j < n; j++) {
            const AttItem *nx = !last ? &its[j] : j < n_after ? &after[j] : NULL;
            const int next_t0 = last && nx ? nx->t0 : t0 + nt, n_next = nx ? tile_keys(nx, next_t0) : 0;
            tile_offsets(t, &its[j], t0, nt, off);
            if (n_next > 0) tile_offsets(t, nx, next_t0, n_next, next);
            tile_rows(t, off, nt, kr, vr, kbuf, vbuf, kv_head_floats_avx512);
            __m512 q[ATT_GROUP][ATT_MAX_HD / 16];
            for (int g = 0; g < nh; g++) scaled_q512(t, its[j].s, its[j].h0 + g, HV, q[g]);
            for (int i = 0; i < nt; i += 4) {
                prefetch_rows(t, next, i, i + 4 < n_next ? i + 4 : n_next);
                for (int g = 0; g < nh; g++) scores4_512(q[g], kr, i, HV, b.sc[j][g]);
            }
            if (n_next > nt) prefetch_rows(t, next, nt, n_next);
            for (int g = 0; g < nh; g++) b.alpha[j][g] = softmax_tile512(b.sc[j][g], nt, &b.m[j][g], &b.l[j][g]);
            weighted_v_tile512(b.acc[j], b.sc[j], b.alpha[j], vr, nt, nh, HV);
        }
    }
    for (int j = 0; j < n; j++) att_finish(t, &its[j], b.acc[j], b.m[j], b.l[j]);
}

/* The rows of a staged item (keys st0.. in sk and sv), tile by tile: each tile's scores for every row and head,
   then their softmax, then their weighted V rows, so that its K rows and then its V rows serve them all from
   L1 (row by row, each row read the stage from L2: twice as slow). Each row's arithmetic is att_row_avx512's,
   in its order. state: ATT_BLOCK_STATE floats, 64-byte aligned. */
static inline AVX512_TARGET __attribute__((always_inline)) void
att_block_avx512(const AttTask *t, const AttItem *rows, int nr, const int HV, const float *sk, const float *sv, int st0,
                 float *state) {
    const int hd = 16 * HV, nh = rows[0].nh;
    BlockState b;
    const float *kr[ATT_TILE], *vr[ATT_TILE];
    block_start(&b, state, nr, nh, hd);
    for (int t0 = st0; t0 < rows[nr - 1].t1; t0 += ATT_TILE) {
        for (int r = 0; r < nr; r++) {
            const int nt = tile_keys(&rows[r], t0);
            if (nt <= 0) continue;
            staged_rows(sk, sv, t0 - st0, nt, hd, kr, vr);
            for (int g = 0; g < nh; g++) {
                __m512 q[ATT_MAX_HD / 16];
                scaled_q512(t, rows[r].s, rows[r].h0 + g, HV, q);
                for (int i = 0; i < nt; i += 4) scores4_512(q, kr, i, HV, b.sc[r][g]);
            }
        }
        for (int r = 0; r < nr; r++) {
            const int nt = tile_keys(&rows[r], t0);
            for (int g = 0; nt > 0 && g < nh; g++)
                b.alpha[r][g] = softmax_tile512(b.sc[r][g], nt, &b.m[r][g], &b.l[r][g]);
        }
        for (int r = 0; r < nr; r++) {
            const int nt = tile_keys(&rows[r], t0);
            if (nt <= 0) continue;
            staged_rows(sk, sv, t0 - st0, nt, hd, kr, vr);
            weighted_v_tile512(b.acc[r], b.sc[r], b.alpha[r], vr, nt, nh, HV);
        }
    }
    for (int r = 0; r < nr; r++) att_finish(t, &rows[r], b.acc[r], b.m[r], b.l[r]);
}

static AVX512_TARGET void att_item_avx512(const void *ctx, int index) {
    const AttTask *t = (const AttTask *)ctx;
    const float *sk, *sv;
    int st0;
    AttItem rows[ATT_BLOCK];
    const int nr = block_rows(t, index, kv_head_floats_avx512, rows, &sk, &sv, &st0);
    float *state = att_stage(t) + 2 * ATT_SPLIT * (size_t)t->hd;
    if (nr == 0) return;
    if (!sk) {
        AttItem after[ATT_BLOCK];
        const int n_after =
            index + 1 < t->n_items && t->items[index + 1].nr == 1 ? head_rows(t, &t->items[index + 1], after) : 0;
        switch (t->hd) {
        case 64: att_rows_avx512(t, rows, nr, after, n_after, 4, state); break;
        case 128: att_rows_avx512(t, rows, nr, after, n_after, 8, state); break;
        default: att_rows_avx512(t, rows, nr, after, n_after, t->hd / 16, state); break;
        }
        return;
    }
    switch (t->hd) {
    case 64: att_block_avx512(t, rows, nr, 4, sk, sv, st0, state); break;
    case 128: att_block_avx512(t, rows, nr, 8, sk, sv, st0, state); break;
    default: att_block_avx512(t, rows, nr, t->hd / 16, sk, sv, st0, state); break;
    }
}
#endif /* QM_X86 */

/* Per-call scratch, grown as needed; used under qm_call_lock only. */
static AttBlock *g_items;
static float *g_part, *g_stage;
static int *g_slot_base;
static size_t g_items_cap, g_part_cap, g_stage_cap, g_slot_base_cap;

static int grow(void **p, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return 0;
    void *n = realloc(*p, need * elem);
    if (!n) return -1;
    *p = n;
    *cap = need;
    return 0;
}

/* Whether row b continues row a's prompt (so their keys can be staged once): one key more, no window cut, and the
   same blocks for the keys row a reads. */
static int same_prompt(const AttTask *t, const int64_t *lens, int a, int b) {
    if (lens[b] != lens[a] + 1 || att_first(t, lens[b]) > 0) return 0;
    const int64_t *ta = t->bt + (size_t)a * t->bt_row, *tb = t->bt + (size_t)b * t->bt_row;
    return ta == tb || !memcmp(ta, tb, sizeof(int64_t) * (size_t)((lens[a] + t->bs - 1) / t->bs));
}

/* Plans the items of a call and runs them; returns -1 when out of memory. */
static int run_attention(AttTask *t, const int64_t *lens, int D) {
    const int group = t->H / t->n_kv;
    t->subs = (group + ATT_GROUP - 1) / ATT_GROUP;
    t->sub = (group + t->subs - 1) / t->subs;
    t->lens = lens;
    size_t n_items = 0, n_slots = 0, row_ranges = 0;
    if (grow((void **)&g_slot_base, &g_slot_base_cap, (size_t)D + 1, sizeof(int)) < 0) return -1;
    for (int s = 0, nr = 1; s < D; s += nr) {
        for (nr = 1; nr < ATT_BLOCK && s + nr < D && same_prompt(t, lens, s + nr - 1, s + nr); nr++) {}
        n_items += (size_t)att_ranges(t, lens[s + nr - 1]) * t->n_kv * t->subs; /* the block's last row has the most */
        if (nr == 1) row_ranges += (size_t)att_ranges(t, lens[s]);
        for (int r = s; r < s + nr; r++) {
            const int ns = att_ranges(t, lens[r]);
            g_slot_base[r] = (int)n_slots;
            if (ns > 1) n_slots += (size_t)ns * t->n_kv * t->subs;
        }
    }
    t->slot_floats = ATT_GROUP * (t->hd + 2);
    const size_t stage = (size_t)qm_pool_threads() * (2 * ATT_SPLIT * (size_t)t->hd + ATT_BLOCK_STATE) + 16;
    if (grow((void **)&g_items, &g_items_cap, n_items + 1, sizeof(AttBlock)) < 0 ||
        grow((void **)&g_part, &g_part_cap, n_slots * t->slot_floats + 1, sizeof(float)) < 0 ||
        grow((void **)&g_stage, &g_stage_cap, stage, sizeof(float)) < 0)
        return -1;
    /* A one-row prompt's KV heads go in spans (att_rows_avx512): as wide as leaves each thread two items and
       keeps a span's tile of K and V within 256 KiB (L2), a divisor of n_kv. Narrower spans read a part of each
       key's heads, strided: four items a thread gave one 1B decode row of 700 keys spans of 2 heads of 8, whose
       attention ran ~1.7x slower than in spans of 4 (16 layers: 2.6-3.0 -> 1.6-1.8 ms). */
    int span = t->subs == 1 ? (t->n_kv < ATT_BLOCK ? t->n_kv : ATT_BLOCK) : 1;
    for (; span > 1; span--)
        if (t->n_kv % span == 0 && row_ranges * (size_t)(t->n_kv / span) >= 2 * (size_t)qm_threads() &&
            2 * ATT_TILE * span * t->head_bytes <= (256 << 10))
            break;
    size_t n = 0;
    for (int s = 0; s < D; s++)
        if (lens[s] == 0) memset(t->out + (size_t)s * t->H * t->hd, 0, sizeof(float) * t->H * t->hd);
    /* Prompt by prompt (a decode row is a prompt of its own), then range by range of its keys, then KV head by
       KV head, then its rows. A prompt's rows read the same keys, so one head's K/V (256 keys: 128 KiB at
       head_dim 64) stays in L2 from row to row (a 512-token prefill's attention ran ~5% faster than row first).
       Every KV head of a key is one stretch of the pool, so a thread that takes a range's heads one after the
       other reads that range's memory whole, and its L2 streamer follows: every row's head 0, then every row's
       head 1, read 256 bytes a key 2 KiB apart, latency-bound (64 decode rows of 192 keys: 78 -> 57 ms a step). */
    for (int p0 = 0, p1; p0 < D; p0 = p1) {
        for (p1 = p0 + 1; p1 < D && same_prompt(t, lens, p1 - 1, p1); p1++) {}
        const int ranges = att_ranges(t, lens[p1 - 1]); /* the prompt's last row has the most */
        const int nkv = p1 - p0 == 1 ? span : 1;
        for (int k = 0; k < ranges; k++)
            for (int kv = 0; kv < t->n_kv; kv += nkv)
                for (int s = p0, nr; s < p1; s += nr) {
                    nr = p1 - s < ATT_BLOCK ? p1 - s : ATT_BLOCK;
                    if (k >= att_ranges(t, lens[s + nr - 1])) continue; /* an earlier block's keys end sooner */
                    for (int h = 0; h < group; h += t->sub)
                        g_items[n++] = (AttBlock){.s = s, .nr = nr, .kv = kv, .h0 = kv * group + h,
                                                  .nh = group - h < t->sub ? group - h : t->sub, .k = k,
                                                  .nkv = nkv};
                }
    }
    t->items = g_items;
    t->n_items = (int)n;
    t->part = g_part;
    t->stage = (float *)(((uintptr_t)g_stage + 63) & ~(uintptr_t)63);
    t->slot_base = g_slot_base;
    qm_item_fn fn = att_item_generic;
#ifdef QM_X86
    if (qm_isa_level() == 2 && t->hd % 32 == 0) fn = att_item_avx512;
    if (qm_isa_level() == 1) fn = att_item_avx2;
#endif
    qm_parallel((int)n, fn, t);
    /* merge the ranges of each row and head: weights exp(m_k - max) on the partial sums */
    for (int s = 0; s < D; s++) {
        const int ns = att_ranges(t, lens[s]);
        for (int hg = 0; ns > 1 && hg < t->n_kv * t->subs; hg++) {
            const int h0 = hg / t->subs * group + hg % t->subs * t->sub, nh = group - hg % t->subs * t->sub;
            const float *part = g_part + (size_t)(g_slot_base[s] + hg * ns) * t->slot_floats;
            for (int g = 0; g < (nh < t->sub ? nh : t->sub); g++) {
                float top = -INFINITY, total = 0.f;
                for (int k = 0; k < ns; k++) {
                    float mk = part[(size_t)k * t->slot_floats + ATT_GROUP * t->hd + g];
                    top = mk > top ? mk : top;
                }
                float *o = t->out + ((size_t)s * t->H + h0 + g) * t->hd;
                memset(o, 0, sizeof(float) * t->hd);
                for (int k = 0; k < ns; k++) {
                    const float *p = part + (size_t)k * t->slot_floats;
                    float w = exp_poly(p[ATT_GROUP * t->hd + g] - top);
                    total += w * p[ATT_GROUP * t->hd + ATT_GROUP + g];
                    for (int d = 0; d < t->hd; d++) o[d] += w * p[(size_t)g * t->hd + d];
                }
                float inv = 1.f / total;
                for (int d = 0; d < t->hd; d++) o[d] *= inv;
            }
        }
    }
    return 0;
}

/* ---- the small ops: one pass each; rows split over the pool when there are many ---- */

#define OPS_ITEM_FLOATS 32768 /* floats per item at least: fewer and the pool costs more than it gives */

typedef struct {
    const float *x, *w, *cos, *sin;
    float *out;
    Py_ssize_t x_row, out_row; /* floats between rows */
    int rows, cols, heads, rows_per_item;
    float eps;
} OpsTask;

INLINE void rms_norm_rows(const OpsTask *t, int r0, int r1) {
    const int K = t->cols;
    for (int r = r0; r < r1; r++) {
        const float *x = t->x + (size_t)r * t->x_row;
        float *o = t->out + (size_t)r * t->out_row;
        float part[LANES] = {0};
        int k = 0;
        for (; k + LANES <= K; k += LANES)
            for (int j = 0; j < LANES; j++) part[j] += x[k + j] * x[k + j];
        float ss = 0.f;
        for (; k < K; k++) ss += x[k] * x[k];
        for (int j = 0; j < LANES; j++) ss += part[j];
        float inv = 1.f / sqrtf(ss / (float)K + t->eps);
        for (k = 0; k < K; k++) o[k] = x[k] * inv * t->w[k];
    }
}

/* rows of heads [heads, cols]; cos and sin [rows, cols / 2] */
INLINE void rope_rows(const OpsTask *t, int r0, int r1) {
    const int hd = t->cols, half = hd / 2;
    for (int r = r0; r < r1; r++) {
        const float *c = t->cos + (size_t)r * half, *s = t->sin + (size_t)r * half;
        for (int h = 0; h < t->heads; h++) {
            const float *x = t->x + (size_t)r * t->x_row + (size_t)h * hd;
            float *o = t->out + (size_t)r * t->out_row + (size_t)h * hd;
            for (int i = 0; i < half; i++) {
                float x1 = x[i], x2 = x[half + i];
                o[i] = x1 * c[i] - x2 * s[i];
                o[half + i] = x2 * c[i] + x1 * s[i];
            }
        }
    }
}

INLINE float silu_mul_one(float g, float u) { return g / (1.f + exp_poly(-g)) * u; }

/* gate | up [rows, 2 * cols] -> silu(gate) * up [rows, cols] */
INLINE void silu_mul_rows(const OpsTask *t, int r0, int r1) {
    const int F = t->cols;
    for (int r = r0; r < r1; r++) {
        const float *g = t->x + (size_t)r * t->x_row, *u = g + F;
        float *o = t->out + (size_t)r * t->out_row;
        for (int k = 0; k < F; k++) o[k] = silu_mul_one(g[k], u[k]);
    }
}

/* An item of the op, compiled for one target: `fn` runs the item's rows by `body` */
#define OPS_ITEM_FN(fn, body, target)                                                 \
    static target void fn(const void *ctx, int i) {                                   \
        const OpsTask *t = (const OpsTask *)ctx;                                      \
        int r0 = i * t->rows_per_item, r1 = r0 + t->rows_per_item;                    \
        body(t, r0, r1 < t->rows ? r1 : t->rows);                                     \
    }

#ifdef QM_X86
/* The portable rows built for each target; OPS_ITEM_FNS_GATE's gated multiplies have SIMD rows of their
   own (op##_rows_avx2, op##_rows_avx512): gcc does not vectorize exp_poly's clamps for AVX2, and for
   AVX-512 it did with two divisions, 8x slower than the AVX2 rows on the same CPU. */
#define OPS_ITEM_FNS(op)                         \
    OPS_ITEM_FN(op##_generic, op##_rows, )       \
    OPS_ITEM_FN(op##_avx2, op##_rows, AVX2_OPS)  \
    OPS_ITEM_FN(op##_avx512, op##_rows, AVX512_TARGET)
#define OPS_ITEM_FNS_GATE(op)                        \
    OPS_ITEM_FN(op##_generic, op##_rows, )           \
    OPS_ITEM_FN(op##_avx2, op##_rows_avx2, AVX2_OPS) \
    OPS_ITEM_FN(op##_avx512, op##_rows_avx512, AVX512_TARGET)
#define OPS_PICK(op) (qm_isa_level() == 2 ? op##_avx512 : qm_isa_level() == 1 ? op##_avx2 : op##_generic)

/* gate | up rows -> g / (1 + exp(op##_argW(g))) * up, W / 32 lanes at a time (W 256 or 512: the intrinsics'
   width in their names), the rest by op##_one */
#define GATED_ROWS_W(op, W, LANES, TARGET, isa)                                                              \
    static inline TARGET __attribute__((always_inline)) void op##_rows_##isa(const OpsTask *t, int r0, int r1) { \
        const int F = t->cols, FV = F & ~(LANES - 1);                                                        \
        const __m##W one = _mm##W##_set1_ps(1.f);                                                            \
        for (int r = r0; r < r1; r++) {                                                                      \
            const float *gr = t->x + (size_t)r * t->x_row, *u = gr + F;                                      \
            float *o = t->out + (size_t)r * t->out_row;                                                      \
            for (int k = 0; k < FV; k += LANES) {                                                            \
                const __m##W g = _mm##W##_loadu_ps(gr + k);                                                  \
                const __m##W s = _mm##W##_div_ps(g, _mm##W##_add_ps(one, exp##W(op##_arg##W(g))));          \
                _mm##W##_storeu_ps(o + k, _mm##W##_mul_ps(s, _mm##W##_loadu_ps(u + k)));                    \
            }                                                                                                \
            for (int k = FV; k < F; k++) o[k] = op##_one(gr[k], u[k]);                                       \
        }                                                                                                    \
    }
#define GATED_ROWS(op)                                  \
    GATED_ROWS_W(op, 256, 8, AVX2_OPS, avx2)            \
    GATED_ROWS_W(op, 512, 16, AVX512_TARGET, avx512)
#else
#define OPS_ITEM_FNS(op) OPS_ITEM_FN(op##_generic, op##_rows, )
#define OPS_ITEM_FNS_GATE(op) OPS_ITEM_FNS(op)
#define OPS_PICK(op) op##_generic
#endif

OPS_ITEM_FNS(rms_norm)
OPS_ITEM_FNS(rope)
#ifdef QM_X86
static inline AVX2_OPS __attribute__((always_inline)) __m256 silu_mul_arg256(__m256 g) {
    return _mm256_sub_ps(_mm256_setzero_ps(), g);
}
static inline AVX512_TARGET __attribute__((always_inline)) __m512 silu_mul_arg512(__m512 g) {
    return _mm512_sub_ps(_mm512_setzero_ps(), g);
}
GATED_ROWS(silu_mul)
#endif
OPS_ITEM_FNS_GATE(silu_mul)

static void run_ops(OpsTask *t, qm_item_fn fn, size_t row_floats) {
    size_t per = OPS_ITEM_FLOATS / (row_floats ? row_floats : 1) + 1;
    int items = (int)((t->rows + per - 1) / per);
    int threads = qm_threads();
    /* no more items than threads: each is a plain streaming pass */
    if (items > threads) {
        items = threads;
        per = (t->rows + items - 1) / items;
    }
    t->rows_per_item = (int)per;
    if (t->rows > 0) qm_parallel((int)((t->rows + per - 1) / per), fn, t);
}

/* ---- the C-level ops (see _qmatmul.h), called with qm_call_lock held ---- */

int qm_bad_table_row(const int64_t *block_tables, Py_ssize_t bt_row, Py_ssize_t bt_cols, const int64_t *lens, int D,
                     int bs, Py_ssize_t blocks) {
    for (int s = 0; s < D; s++) {
        const int64_t len = lens[s], used = (len + bs - 1) / bs;
        if (len < 0 || used > bt_cols) return s;
        for (int64_t b = 0; b < used; b++) {
            const int64_t id = block_tables[(size_t)s * bt_row + b];
            if (id < 0 || id >= blocks) return s;
        }
    }
    return -1;
}

int qm_attention(const float *q, Py_ssize_t q_row, const void *k, const void *v, int kv_type, int bs, int n_kv,
                 const int64_t *block_tables, Py_ssize_t bt_row, const int64_t *lens, int D, int H, int hd,
                 float scale, int window, float *out) {
    AttTask t = {.q = q, .k = (const char *)k, .v = (const char *)v, .bt = block_tables, .out = out, .q_row = q_row,
                 .bt_row = bt_row, .head_bytes = qm_kv_head_bytes(kv_type, hd), .H = H, .hd = hd, .bs = bs,
                 .n_kv = n_kv, .kv_type = kv_type, .window = window, .scale = scale};
    return run_attention(&t, lens, D);
}

void qm_write_kv(void *cache, int kv_type, const float *values, Py_ssize_t values_row, const int64_t *slots, int rows,
                 int n_kv, int hd) {
    const size_t head = qm_kv_head_bytes(kv_type, hd);
#ifdef QM_X86
    if (kv_type == QM_KV_F16 && hd % 8 == 0 && qm_isa_level() >= 1) {
        for (int i = 0; i < rows; i++)
            for (int h = 0; h < n_kv; h++)
                kv_head_store_f16c((char *)cache + ((size_t)slots[i] * n_kv + h) * head,
                                   values + (size_t)i * values_row + (size_t)h * hd, hd);
        return;
    }
#endif
    for (int i = 0; i < rows; i++)
        for (int h = 0; h < n_kv; h++)
            kv_head_store((char *)cache + ((size_t)slots[i] * n_kv + h) * head, kv_type,
                          values + (size_t)i * values_row + (size_t)h * hd, hd);
}

void qm_rms_norm(const float *x, Py_ssize_t x_row, const float *w, float *out, Py_ssize_t out_row, int rows, int cols,
                 float eps) {
    OpsTask t = {.x = x, .w = w, .out = out, .x_row = x_row, .out_row = out_row, .rows = rows, .cols = cols, .eps = eps};
    run_ops(&t, OPS_PICK(rms_norm), (size_t)cols);
}

void qm_rope(const float *x, Py_ssize_t x_row, const float *cos, const float *sin, float *out, int rows, int heads,
             int hd) {
    OpsTask t = {.x = x, .cos = cos, .sin = sin, .out = out, .x_row = x_row, .out_row = (Py_ssize_t)heads * hd,
                 .rows = rows, .heads = heads, .cols = hd};
    run_ops(&t, OPS_PICK(rope), (size_t)heads * hd);
}

void qm_silu_mul(const float *x, Py_ssize_t x_row, float *out, Py_ssize_t out_row, int rows, int cols) {
    OpsTask t = {.x = x, .out = out, .x_row = x_row, .out_row = out_row, .rows = rows, .cols = cols};
    run_ops(&t, OPS_PICK(silu_mul), (size_t)cols);
}

/* ---- Python entry points ---- */


typedef struct {
    Py_buffer b[8];
    int n;
} Buffers;

static void release(Buffers *bs) {
    for (int i = 0; i < bs->n; i++) PyBuffer_Release(&bs->b[i]);
    bs->n = 0;
}

/* Takes buffer i of args (float32 unless `format` says otherwise); NULL with an error set on failure. */
static Py_buffer *take(Buffers *bs, PyObject *o, int writable) {
    Py_buffer *b = &bs->b[bs->n];
    if (PyObject_GetBuffer(o, b, (writable ? PyBUF_WRITABLE : 0) | PyBUF_STRIDES | PyBUF_FORMAT) < 0) return NULL;
    bs->n++;
    return b;
}

int qm_is_f32(const Py_buffer *b) { return b->itemsize == 4 && b->format && !strcmp(b->format, "f"); }

/* Whether b holds integers of itemsize bytes: its format one of the type codes in `codes`, after an optional
   native or little-endian byte-order mark. */
static int int_format(const Py_buffer *b, Py_ssize_t itemsize, const char *codes) {
    if (b->itemsize != itemsize || !b->format) return 0;
    const char *f = b->format;
    if (*f == '<' || *f == '=' || *f == '@') f++;
    return f[0] && !f[1] && strchr(codes, f[0]);
}

int qm_is_i64(const Py_buffer *b) { return int_format(b, 8, "lq"); }
int qm_is_u32(const Py_buffer *b) { return int_format(b, 4, "IL"); }

static int c_contiguous(const Py_buffer *b) {
    Py_ssize_t step = b->itemsize;
    for (int i = b->ndim - 1; i >= 0; i--) {
        if (b->shape[i] > 1 && b->strides[i] != step) return 0;
        step *= b->shape[i];
    }
    return 1;
}

/* A row stride in elements, or -1 when rows are not a whole number of elements apart. */
static Py_ssize_t row_stride(const Py_buffer *b) {
    if (b->shape[0] <= 1) return 0;
    return b->strides[0] % b->itemsize || b->strides[0] < 0 ? -1 : b->strides[0] / b->itemsize;
}

/* attention(q, k_cache, v_cache, block_tables, context_lens, out, scale[, window]) -> bool
   q float32 [D, H, hd] (rows at any stride, heads contiguous); pools of one QM_KV type [blocks, bs,
   n_kv, head] C-contiguous; block_tables int64 [D, max_blocks]; context_lens int64 [D]; out float32 [D, H, hd]
   C-contiguous; window > 0: each row attends to its last `window` keys only. Raises on block ids or
   lengths outside the pool. */
PyObject *qm_py_attention(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 7 && nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "attention takes 7 or 8 arguments");
        return NULL;
    }
    double scale = PyFloat_AsDouble(args[6]);
    if (scale == -1.0 && PyErr_Occurred()) return NULL;
    long window = nargs == 8 ? PyLong_AsLong(args[7]) : 0;
    if (window == -1 && PyErr_Occurred()) return NULL;
    if (window < 0 || window > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "attention: window must be 0 (none) or a positive int");
        return NULL;
    }
    Buffers bs = {.n = 0};
    Py_buffer *q, *k, *v, *bt, *cl, *o;
    if (!(q = take(&bs, args[0], 0)) || !(k = take(&bs, args[1], 0)) || !(v = take(&bs, args[2], 0)) ||
        !(bt = take(&bs, args[3], 0)) || !(cl = take(&bs, args[4], 0)) || !(o = take(&bs, args[5], 1))) {
        release(&bs);
        return NULL;
    }
    int ok = q->ndim == 3 && k->ndim == 4 && v->ndim == 4 && bt->ndim == 2 && cl->ndim == 1 && o->ndim == 3 &&
             qm_is_f32(q) && qm_is_f32(o) && qm_is_i64(bt) && qm_is_i64(cl);
    const int kv_type = ok ? qm_kv_type(k, q->shape[2]) : -1;
    if (ok) {
        Py_ssize_t D = q->shape[0], H = q->shape[1], hd = q->shape[2];
        ok = hd > 0 && hd <= ATT_MAX_HD && kv_type >= 0 && qm_kv_type(v, hd) == kv_type && k->shape[2] > 0 &&
             H % k->shape[2] == 0 &&
             q->strides[2] == 4 && q->strides[1] == 4 * hd && row_stride(q) >= 0 && c_contiguous(k) &&
             c_contiguous(v) && c_contiguous(o) && c_contiguous(cl) && bt->strides[1] == 8 && row_stride(bt) >= 0 &&
             bt->shape[0] == D && cl->shape[0] == D && o->shape[0] == D && o->shape[1] == H && o->shape[2] == hd;
        for (int i = 0; ok && i < 4; i++) ok = k->shape[i] == v->shape[i];
    }
    if (!ok) {
        release(&bs);
        Py_RETURN_FALSE;
    }
    const int64_t *lens = (const int64_t *)cl->buf, *table = (const int64_t *)bt->buf;
    const int D = (int)q->shape[0], bsz = (int)k->shape[1];
    const Py_ssize_t bt_row = row_stride(bt);
    const int bad = qm_bad_table_row(table, bt_row, bt->shape[1], lens, D, bsz, k->shape[0]);
    if (bad >= 0) {
        release(&bs);
        PyErr_Format(PyExc_ValueError, "attention: row %d's context length or block ids fall outside the pool", bad);
        return NULL;
    }
    int err;
    WITH_POOL(err = qm_attention((const float *)q->buf, row_stride(q), k->buf, v->buf, kv_type, bsz, (int)k->shape[2], table, bt_row, lens, D, (int)q->shape[1], (int)q->shape[2],
                                 (float)scale, (int)window, (float *)o->buf));
    release(&bs);
    if (err) return PyErr_NoMemory();
    Py_RETURN_TRUE;
}

/* Rows of a 2-D float32 buffer: unit column stride, rows at any whole stride. */
static int rows_ok(const Py_buffer *b, Py_ssize_t rows, Py_ssize_t cols) {
    return b->ndim == 2 && qm_is_f32(b) && b->shape[0] == rows && b->shape[1] == cols &&
           (cols <= 1 || b->strides[1] == 4) && row_stride(b) >= 0;
}

/* rms_norm(x, w, out, eps) -> bool: out = x / sqrt(mean(x^2) + eps) * w for x, out float32 [R, K]. */
PyObject *qm_py_rms_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "rms_norm takes 4 arguments");
        return NULL;
    }
    double eps = PyFloat_AsDouble(args[3]);
    if (eps == -1.0 && PyErr_Occurred()) return NULL;
    Buffers bs = {.n = 0};
    Py_buffer *x, *w, *o;
    if (!(x = take(&bs, args[0], 0)) || !(w = take(&bs, args[1], 0)) || !(o = take(&bs, args[2], 1))) {
        release(&bs);
        return NULL;
    }
    if (x->ndim != 2 || !rows_ok(x, x->shape[0], x->shape[1]) || !rows_ok(o, x->shape[0], x->shape[1]) ||
        w->ndim != 1 || !qm_is_f32(w) || w->shape[0] != x->shape[1] || (w->shape[0] > 1 && w->strides[0] != 4)) {
        release(&bs);
        Py_RETURN_FALSE;
    }
    WITH_POOL(qm_rms_norm((const float *)x->buf, row_stride(x), (const float *)w->buf, (float *)o->buf, row_stride(o),
                          (int)x->shape[0], (int)x->shape[1], (float)eps));
    release(&bs);
    Py_RETURN_TRUE;
}

/* rope(x, cos, sin, out) -> bool: rotate-half RoPE of x float32 [T, H, hd] (rows at any stride,
   heads contiguous) into out [T, H, hd] C-contiguous; cos, sin hold T * hd / 2 floats, row-major. */
PyObject *qm_py_rope(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "rope takes 4 arguments");
        return NULL;
    }
    Buffers bs = {.n = 0};
    Py_buffer *x, *c, *s, *o;
    if (!(x = take(&bs, args[0], 0)) || !(c = take(&bs, args[1], 0)) || !(s = take(&bs, args[2], 0)) ||
        !(o = take(&bs, args[3], 1))) {
        release(&bs);
        return NULL;
    }
    int ok = x->ndim == 3 && o->ndim == 3 && qm_is_f32(x) && qm_is_f32(o) && qm_is_f32(c) && qm_is_f32(s) && c_contiguous(c) &&
             c_contiguous(s) && c_contiguous(o);
    if (ok) {
        Py_ssize_t T = x->shape[0], H = x->shape[1], hd = x->shape[2];
        ok = hd % 2 == 0 && x->strides[2] == 4 && x->strides[1] == 4 * hd && row_stride(x) >= 0 &&
             o->shape[0] == T && o->shape[1] == H && o->shape[2] == hd && c->len == T * hd / 2 * 4 && s->len == c->len;
    }
    if (!ok) {
        release(&bs);
        Py_RETURN_FALSE;
    }
    WITH_POOL(qm_rope((const float *)x->buf, row_stride(x), (const float *)c->buf, (const float *)s->buf,
                      (float *)o->buf, (int)x->shape[0], (int)x->shape[1], (int)x->shape[2]));
    release(&bs);
    Py_RETURN_TRUE;
}

/* silu_mul(gate_up, out[, gelu]) -> bool: out = silu(gate) * up for gate_up float32 [R, 2F], out [R, F];
   with gelu true, gelu(gate) * up (GELU in its tanh approximation). */
PyObject *qm_py_silu_mul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2 && nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "silu_mul takes 2 or 3 arguments");
        return NULL;
    }
    const int gelu = nargs == 3 ? PyObject_IsTrue(args[2]) : 0;
    if (gelu < 0) return NULL;
    Buffers bs = {.n = 0};
    Py_buffer *x, *o;
    if (!(x = take(&bs, args[0], 0)) || !(o = take(&bs, args[1], 1))) {
        release(&bs);
        return NULL;
    }
    if (x->ndim != 2 || x->shape[1] % 2 || !rows_ok(x, x->shape[0], x->shape[1]) ||
        !rows_ok(o, x->shape[0], x->shape[1] / 2)) {
        release(&bs);
        Py_RETURN_FALSE;
    }
    WITH_POOL((gelu ? qm_gelu_tanh_mul : qm_silu_mul)((const float *)x->buf, row_stride(x), (float *)o->buf,
                                                      row_stride(o), (int)x->shape[0], (int)x->shape[1] / 2));
    release(&bs);
    Py_RETURN_TRUE;
}

/* write_kv(cache, values, slots) -> bool: cache rows `slots` (of its [blocks * block_size] rows
   [n_kv, head], a QM_KV type) = values float32 [T, n_kv, hd] (rows at any stride), converted;
   slots int64 [T]. Small copies (a row per decode step): the GIL stays held. */
PyObject *qm_py_write_kv(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "write_kv takes 3 arguments");
        return NULL;
    }
    Buffers bs = {.n = 0};
    Py_buffer *c, *x, *sl;
    if (!(c = take(&bs, args[0], 1)) || !(x = take(&bs, args[1], 0)) || !(sl = take(&bs, args[2], 0))) {
        release(&bs);
        return NULL;
    }
    const int kv_type = x->ndim == 3 ? qm_kv_type(c, x->shape[2]) : -1;
    int ok = kv_type >= 0 && sl->ndim == 1 && qm_is_f32(x) && qm_is_i64(sl) && c_contiguous(c) && c_contiguous(sl) &&
             x->shape[0] == sl->shape[0] && x->shape[1] == c->shape[2] && x->strides[2] == 4 &&
             x->strides[1] == 4 * x->shape[2] && row_stride(x) >= 0;
    const int64_t *slots = (const int64_t *)sl->buf;
    const Py_ssize_t rows = ok ? c->shape[0] * c->shape[1] : 0;
    for (Py_ssize_t i = 0; ok && i < sl->shape[0]; i++) ok = slots[i] >= 0 && slots[i] < rows;
    if (!ok) {
        release(&bs);
        Py_RETURN_FALSE;
    }
    qm_write_kv(c->buf, kv_type, (const float *)x->buf, row_stride(x), slots, (int)sl->shape[0], (int)x->shape[1],
                (int)x->shape[2]);
    release(&bs);
    Py_RETURN_TRUE;
}

/* ---- the sampler's ops (_logits.c) ---- */

static int is_f64(const Py_buffer *b) { return b->itemsize == 8 && b->format && !strcmp(b->format, "d"); }

static int is_i32(const Py_buffer *b) { return int_format(b, 4, "il"); }

/* Whether x is float32 [*, V] with unit column stride and rows a 1-D int64 array of its rows; each of the `n`
   outputs a C-contiguous array whose first dimension has as many entries as rows. */
static int logit_rows_ok(const Py_buffer *x, const Py_buffer *rows, Py_buffer *const *outs, int n) {
    if (x->ndim != 2 || !qm_is_f32(x) || (x->shape[1] > 1 && x->strides[1] != 4) || row_stride(x) < 0 ||
        x->shape[1] > INT32_MAX || rows->ndim != 1 || !qm_is_i64(rows) || !c_contiguous(rows))
        return 0;
    for (int i = 0; i < n; i++)
        if (outs[i]->ndim < 1 || outs[i]->shape[0] != rows->shape[0] || !c_contiguous(outs[i])) return 0;
    const int64_t *r = (const int64_t *)rows->buf;
    for (Py_ssize_t i = 0; i < rows->shape[0]; i++)
        if (r[i] < 0 || r[i] >= x->shape[0]) return 0;
    return 1;
}

/* logit_stats(x, rows, norm, top) -> bool: x float32 [*, V]; rows int64 [R]; norm float64 [R] = each row's
   log-sum-exp (NaN where its max is not finite); top int64 [R, k], k <= QM_MAX_TOP: its k largest entries' ids. */
PyObject *qm_py_logit_stats(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "logit_stats takes 4 arguments");
        return NULL;
    }
    Buffers bs = {.n = 0};
    Py_buffer *x, *r, *nm, *top;
    if (!(x = take(&bs, args[0], 0)) || !(r = take(&bs, args[1], 0)) || !(nm = take(&bs, args[2], 1)) ||
        !(top = take(&bs, args[3], 1))) {
        release(&bs);
        return NULL;
    }
    Py_buffer *outs[2] = {nm, top};
    if (!logit_rows_ok(x, r, outs, 2) || nm->ndim != 1 || !is_f64(nm) || top->ndim != 2 || !qm_is_i64(top) ||
        top->shape[1] > QM_MAX_TOP || top->shape[1] > x->shape[1]) {
        release(&bs);
        Py_RETURN_FALSE;
    }
    WITH_POOL(qm_logit_stats((const float *)x->buf, row_stride(x), (const int64_t *)r->buf, (int)r->shape[0],
                             (int)x->shape[1], (int)top->shape[1], (double *)nm->buf, (int64_t *)top->buf));
    release(&bs);
    Py_RETURN_TRUE;
}

/* sample_logits(x, rows, inv_t, top_k, top_p, min_p, u, token) -> bool: x float32 [*, V]; rows int64 [R]; each
   row's 1 / temperature (float32 [R]), cuts (int32, float32, float32 [R]) and uniform in [0, 1) (float64 [R]);
   token int64 [R] = the token drawn, or -1 where the row is left to the caller (see qm_sample_logits). */
PyObject *qm_py_sample_logits(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "sample_logits takes 8 arguments");
        return NULL;
    }
    Buffers bs = {.n = 0};
    Py_buffer *b[8];
    for (int i = 0; i < 8; i++)
        if (!(b[i] = take(&bs, args[i], i == 7))) {
            release(&bs);
            return NULL;
        }
    if (!logit_rows_ok(b[0], b[1], b + 2, 6) || !qm_is_f32(b[2]) || !is_i32(b[3]) || !qm_is_f32(b[4]) ||
        !qm_is_f32(b[5]) || !is_f64(b[6]) || !qm_is_i64(b[7])) {
        release(&bs);
        Py_RETURN_FALSE;
    }
    WITH_POOL(qm_sample_logits((const float *)b[0]->buf, row_stride(b[0]), (const int64_t *)b[1]->buf,
                               (int)b[1]->shape[0], (int)b[0]->shape[1], (const float *)b[2]->buf,
                               (const int32_t *)b[3]->buf, (const float *)b[4]->buf, (const float *)b[5]->buf,
                               (const double *)b[6]->buf, (int64_t *)b[7]->buf));
    release(&bs);
    Py_RETURN_TRUE;
}

/* ---- ops of the other families' blocks (Qwen 3 and Gemma 3): q/k head norms and the GELU gate ---- */

/* gate | up [rows, 2 * cols] -> gelu(gate) * up [rows, cols], GELU in its tanh approximation written
   as g * sigmoid(2u), u = sqrt(2 / pi) (g + 0.044715 g^3): 0.5 (1 + tanh u) = 1 / (1 + exp(-2u)), and
   exp_poly vectorizes where tanhf does not */
INLINE float gelu_tanh_mul_one(float g, float u) {
    const float a = 0.7978845608f * (g + 0.044715f * g * g * g);
    return g / (1.f + exp_poly(-2.f * a)) * u;
}

INLINE void gelu_tanh_mul_rows(const OpsTask *t, int r0, int r1) {
    const int F = t->cols;
    for (int r = r0; r < r1; r++) {
        const float *g = t->x + (size_t)r * t->x_row, *u = g + F;
        float *o = t->out + (size_t)r * t->out_row;
        for (int k = 0; k < F; k++) o[k] = gelu_tanh_mul_one(g[k], u[k]);
    }
}

/* rows of `heads` heads [cols] each, normed in place: rms_norm_rows on each row's heads as rows */
INLINE void head_rms_norm_rows(const OpsTask *t, int r0, int r1) {
    for (int r = r0; r < r1; r++) {
        OpsTask heads = *t;
        heads.x = heads.out = t->out + (size_t)r * t->out_row;
        heads.x_row = heads.out_row = t->cols;
        rms_norm_rows(&heads, 0, t->heads);
    }
}

#ifdef QM_X86
/* -2u of gelu_tanh_mul_one */
static inline AVX2_OPS __attribute__((always_inline)) __m256 gelu_tanh_mul_arg256(__m256 g) {
    return _mm256_mul_ps(_mm256_set1_ps(-1.5957691216f),
                         _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), g), _mm256_mul_ps(g, g), g));
}
static inline AVX512_TARGET __attribute__((always_inline)) __m512 gelu_tanh_mul_arg512(__m512 g) {
    return _mm512_mul_ps(_mm512_set1_ps(-1.5957691216f),
                         _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), g), _mm512_mul_ps(g, g), g));
}
GATED_ROWS(gelu_tanh_mul)
#endif
OPS_ITEM_FNS_GATE(gelu_tanh_mul)
OPS_ITEM_FNS(head_rms_norm)

void qm_gelu_tanh_mul(const float *x, Py_ssize_t x_row, float *out, Py_ssize_t out_row, int rows, int cols) {
    OpsTask t = {.x = x, .out = out, .x_row = x_row, .out_row = out_row, .rows = rows, .cols = cols};
    run_ops(&t, OPS_PICK(gelu_tanh_mul), (size_t)cols);
}

void qm_head_rms_norm(float *x, Py_ssize_t x_row, const float *w, int rows, int heads, int hd, float eps) {
    OpsTask t = {.x = x, .w = w, .out = x, .x_row = x_row, .out_row = x_row, .rows = rows, .heads = heads,
                 .cols = hd, .eps = eps};
    run_ops(&t, OPS_PICK(head_rms_norm), (size_t)heads * hd);
}
