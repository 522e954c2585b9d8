/* Quantized matmul kernels for edgeserve's NumPy backend: out = x @ W.T from 4/8-bit weights.

Layout (built by qmatmul.prepare): output columns are cut into panels of 16; a panel's weights
are uint32 words [K / epw, 16], one word per (k-chunk, column), so 16 columns' words make one
512-bit vector. A word holds the column's weights for epw = 32 / bits consecutive k, placed so
that `(word >> s) & mask` yields two weights of adjacent k as the low and high int16 halves of
an int32 lane:
    4 bits: nibble i (bits 4i..4i+3) = w[k0 + 2i] for i < 4, w[k0 + 2(i - 4) + 1] for i >= 4
    8 bits: byte order w[k0], w[k0 + 2], w[k0 + 1], w[k0 + 3]
Scales and biases are [panels, K / group, 16] float16 or float32. Symmetric groups (GGUF Q4_0,
Q5_0, Q8_0: bias = -center * scale, exact in float32) keep no biases, so a decode step reads the
GGUF's bytes and no more (Q4_0 read 20 bytes per 32 weights with the biases stored, against GGUF's
18: a 1B decode pass took 7% longer): their activation sums are taken times -center instead (the
center is a power of two, so b * sum(x) = s * (-center * sum(x)) to the bit) and the scale serves as
the bias.

K-quant segments (GGUF Q4_K/Q5_K/Q6_K, see quant/kquants.py) keep two-level scales instead:
int8 sc and m [panels, K / group, 16] and float16/float32 d and dmin [panels, K / 256, 16] (passed
as scales and biases), a group's scale and bias being d * sc and dmin * m. Their 5th and 6th bits
(hbits = 1 or 2) sit in a second plane of uint32 words [K * hbits / 32, 16] per panel, a word
holding 32 / hbits consecutive k: pair p (k0 + 2p, k0 + 2p + 1) at bits hbits * p of the low and
high int16 halves, so one shift and mask line them up with the 4-bit pairs, then << 4. The
groups (32 for Q5_K, 16 for Q6_K) make one high-bit word each.

Kernels: each row of x is quantized per weight group to integers and its float sum per group is
kept, so a group's contribution is s * d_x * sum(q * x_q) + b * sum(x). Two activation widths
(set_activation_bits; one setting for the process, like the thread count):
  int16 (scale = max|x| / 32767, an error below 2^-16 of the group's largest value, far inside
    float32 model noise): the integer dots run as vpdpwssd (AVX-512 VNNI) or vpmaddwd (AVX2), 32 /
    16 multiply-adds per instruction against 16 / 8 for float32 FMA; the exact path.
  int8 (scale = max|x| / 127, as llama.cpp quantizes activations for its q4_0 / q8_0 / q4_K dots):
    vpmaddubsw of unsigned weights and int8 activations, then vpmaddwd with ones (AVX2), 32
    multiply-adds an instruction and half the unpacking of 4-bit words; on AVX-512 VNNI, vpdpbusd
    on whole panels, 64 an instruction (prompts 1.5-1.7x faster than the AVX2 path on the same CPU).
Every unpacked weight vector serves several rows from registers. A group's integer dot must fit
int32: (2^bits - 1) * 32767 * group < 2^31, checked when the arguments are parsed (8-bit weights
allow groups up to 256). Work is (row tile, panel chunk) items run by the thread pool of _pool.c:
each thread takes the items of its own contiguous range in order (so it streams neighbouring
panels, which keeps the hardware prefetcher running: a single shared counter handing out
alternate chunks made decode 30% slower), then takes what is left of the others' ranges, so a
descheduled worker only delays the items it holds. The AVX2 and AVX-512 paths need FMA and F16C
besides (float16 scales), checked with the CPU's features before either is chosen.
*/
#include "_qmatmul.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PANEL 16
/* Bytes ahead in a panel's weight words that the SIMD kernels ask for with a prefetch (panels are
   consecutive, so past a panel's end it reaches the next one's): on a shared 2-core Zen 3 a decode
   pass read 10-30% faster with 1-8 KiB than with the hardware prefetcher alone. One thread reads at
   most ~25 GB/s, where 4 KiB is ~160 ns of reading: a 1B Q4_K_M decode on one thread (Zen 4) ran
   10% faster than with 2 KiB (27.7-28.5 -> 30.7-31.4 tok/s); two threads and 16-64 rows the same.
   With panels on cache lines a core reads ~30 GB/s, and 6 KiB went further: 1B decode on one thread, Q4_0
   41.7-42.4 -> 43.7-44.4 tok/s, Q4_K_M 37.6-39.2 -> 39.6-41.3 (alternating pairs); 4 rows 1-3% slower, 16 the
   same. AVX-512 Q4_K tiles of fewer than 4 rows are the exception (HW_STREAM). */
#define PREFETCH_AHEAD 6144
#define PREFETCH(p) _mm_prefetch((const char *)(p) + PREFETCH_AHEAD, _MM_HINT_T0)
/* Whether an AVX-512 K-quant tile of RB rows (HB high bits) leaves its weights to the hardware prefetcher. For
   Q4_K's one to three rows it reads faster alone (Zen 4, one thread, a 1B weight pass in huge pages: 1 / 2 / 3
   rows 26.1 / 24.0 / 22.7 -> 29.2 / 27.5 / 24.2 GB/s, the plain read's 30 at one row; 1B Q4_K_M decode 36.8 ->
   41.2 tok/s); from 4 rows on, for Q5_K and Q6_K at any rows, and in the AVX2 kernels (-4% to +3%), the prefetch
   wins or ties (8 rows: 8.7 -> 11.4 GB/s). */
#define HW_STREAM(HB, RB) ((HB) == 0 && (RB) < 4)
#define ROW_TILE 64

typedef struct Task {
    const uint32_t *w;
    const void *scales, *biases; /* biases NULL: symmetric groups, xs holds -center * sum(x) (QmMatrix) */
    const int16_t *xq;  /* [R, K] int16 activations, or NULL */
    const int8_t *x8;   /* [R, K] int8 activations in the weights' byte order (see quantize_rows8), or NULL;
                           super-block-major [K / 256, R, 256] for the super-block kernels (sb_x) */
    const int32_t *xi;  /* [R, K / group] sum of a group's int8 activations (8-bit weights) */
    const int16_t *xi16; /* the same as int16, for the super-block path's vpmaddwd of two groups */
    const float *xd;    /* [R, K / group] activation scale per group */
    const float *xs;    /* [R, K / group] activation sum per group */
    float *out;
    Py_ssize_t ldo;     /* floats between rows of out */
    int R, K, N, bits, group, f16;
    const uint32_t *hw;      /* high-bit plane, or NULL */
    const int8_t *ksc, *km;  /* K-quant group scales and mins, or NULL */
    int hbits, kq;
    int sb;             /* activations scaled per super-block of 256 (xd [R, K / 256]), see avx2_tile_sb */
    int panels, chunk, row_tiles, items;
    void (*kernel)(const struct Task *, int p0, int p1, int r0, int r1);
} Task;

typedef void (*kernel_fn)(const Task *, int p0, int p1, int r0, int r1);

/* Row r's int8 activation k for the super-block kernels, whose rows' 256 values of a super-block lie side by
   side: a tile's rows K bytes apart fell in a few L1 sets (K a multiple of 4 KiB: all in one), and 64-row K-quant
   matmuls of a 1B model ran 6% faster with them adjacent (16 rows: 4%). */
static inline const int8_t *sb_x(const Task *t, int r, int k) {
    return t->x8 + ((size_t)(k >> 8) * t->R + r) * 256 + (k & 255);
}

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bitsv;
    if (exp == 0x1f) {
        bitsv = sign | 0x7f800000 | (man << 13);
    } else if (exp) {
        bitsv = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) { /* subnormal: normalize */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400));
        bitsv = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
    } else {
        bitsv = sign;
    }
    float f;
    memcpy(&f, &bitsv, 4);
    return f;
}

static inline float load_scale(const void *a, size_t i, int f16) {
    return f16 ? f16_to_f32(((const uint16_t *)a)[i]) : ((const float *)a)[i];
}

/* facc += the group's integer dots acc scaled: s * d_x * acc + b * sum(x), per column of the panel. */
static inline void group_update(const Task *t, int p, int g, int r, const int32_t *acc, float *facc) {
    const int K = t->K, ng = K / t->group;
    size_t so = ((size_t)p * ng + g) * PANEL;
    float d = t->xd[(size_t)r * ng + g], sx = t->xs[(size_t)r * ng + g];
    size_t dofs = ((size_t)p * (K / 256) + g * t->group / 256) * PANEL;
    for (int c = 0; c < PANEL; c++) {
        float s, b;
        if (t->kq) {
            s = load_scale(t->scales, dofs + c, t->f16) * (float)t->ksc[so + c];
            b = load_scale(t->biases, dofs + c, t->f16) * (float)t->km[so + c];
        } else {
            s = load_scale(t->scales, so + c, t->f16);
            b = t->biases ? load_scale(t->biases, so + c, t->f16) : s;
        }
        facc[c] += (float)acc[c] * (s * d) + b * sx;
    }
}

/* ---- portable kernel: plain loops over the 16 lanes, which gcc and clang vectorize (NEON too) ---- */

static void kernel_generic(const Task *t, int p0, int p1, int r0, int r1) {
    const int K = t->K, G = t->group, ng = K / G, epw = 32 / t->bits, wpg = G / epw, hb = t->hbits;
    const uint32_t hm = (1u << hb) - 1;
    for (int p = p0; p < p1; p++) {
        const uint32_t *wp = t->w + (size_t)p * (K / epw) * PANEL;
        const uint32_t *hp = hb ? t->hw + (size_t)p * (K * hb / 32) * PANEL : NULL;
        int ncols = t->N - p * PANEL < PANEL ? t->N - p * PANEL : PANEL;
        for (int r = r0; r < r1; r++) {
            float facc[PANEL] = {0};
            const int32_t *xr = (const int32_t *)(t->xq + (size_t)r * K);
            for (int g = 0; g < ng; g++) {
                int32_t acc[PANEL] = {0};
                const uint32_t *wg = wp + (size_t)g * wpg * PANEL;
                const int32_t *xg = xr + g * G / 2;
                for (int j = 0; j < wpg; j++) {
                    const uint32_t *v = wg + j * PANEL;
                    const int jg = g * wpg + j;
                    const uint32_t *hv = hb ? hp + (size_t)(jg * hb / 4) * PANEL : NULL;
                    const int hbase = hb ? hb * 4 * (jg % (4 / hb)) : 0;
                    for (int pr = 0; pr < epw / 2; pr++) {
                        int32_t xp = xg[j * (epw / 2) + pr];
                        int32_t xa = (int16_t)(xp & 0xffff), xb = (int16_t)((uint32_t)xp >> 16);
                        int sh = t->bits == 4 ? 4 * pr : 8 * pr;
                        uint32_t m = t->bits == 4 ? 0xf : 0xff;
                        for (int c = 0; c < PANEL; c++) {
                            uint32_t u = v[c] >> sh;
                            int32_t lo = (int32_t)(u & m), hi = (int32_t)((u >> 16) & m);
                            if (hv) {
                                uint32_t h = hv[c] >> (hbase + hb * pr);
                                lo |= (int32_t)((h & hm) << 4);
                                hi |= (int32_t)(((h >> 16) & hm) << 4);
                            }
                            acc[c] += lo * xa + hi * xb;
                        }
                    }
                }
                group_update(t, p, g, r, acc, facc);
            }
            memcpy(t->out + (size_t)r * t->ldo + p * PANEL, facc, sizeof(float) * ncols);
        }
    }
}

/* The high bit(s) of byte b of a 4-bit word's low (odd = 0) or high (odd = 1) nibbles, at bit 0:
   the bytes are pairs 0, 2 (low halves) then 0, 2 (high halves) of the word's k-chunk, odd
   nibbles pairs 1, 3 (see quantize_rows8), and pair p's bits sit at hb * p of each int16 half. */
static inline uint32_t hi_byte(uint32_t h, int hbase, int hb, int b, int odd) {
    return (h >> (hbase + hb * (2 * (b & 1) + odd) + 16 * (b >> 1))) & ((1u << hb) - 1);
}

/* int8 activations (x8 in the weights' byte order): integer dots of unsigned weights, as the AVX2
   kernel computes them, so both give the same integers. */
static void kernel_generic8(const Task *t, int p0, int p1, int r0, int r1) {
    const int K = t->K, G = t->group, ng = K / G, epw = 32 / t->bits, wpg = G / epw, hb = t->hbits;
    for (int p = p0; p < p1; p++) {
        const uint32_t *wp = t->w + (size_t)p * (K / epw) * PANEL;
        const uint32_t *hp = hb ? t->hw + (size_t)p * (K * hb / 32) * PANEL : NULL;
        int ncols = t->N - p * PANEL < PANEL ? t->N - p * PANEL : PANEL;
        for (int r = r0; r < r1; r++) {
            float facc[PANEL] = {0};
            for (int g = 0; g < ng; g++) {
                int32_t acc[PANEL] = {0};
                for (int j = 0; j < wpg; j++) {
                    const int jg = g * wpg + j;
                    const uint32_t *v = wp + (size_t)jg * PANEL;
                    const int8_t *xb = t->x8 + (size_t)r * K + (size_t)jg * epw;
                    const uint32_t *hv = hb ? hp + (size_t)(jg * hb / 4) * PANEL : NULL;
                    const int hbase = hb ? hb * 4 * (jg % (4 / hb)) : 0;
                    for (int c = 0; c < PANEL; c++) {
                        for (int b = 0; b < 4; b++) {
                            if (t->bits == 8) {
                                acc[c] += (int32_t)((v[c] >> (8 * b)) & 0xff) * xb[b];
                                continue;
                            }
                            uint32_t lo = (v[c] >> (8 * b)) & 0xf, hi = (v[c] >> (8 * b + 4)) & 0xf;
                            if (hv) {
                                lo |= hi_byte(hv[c], hbase, hb, b, 0) << 4;
                                hi |= hi_byte(hv[c], hbase, hb, b, 1) << 4;
                            }
                            acc[c] += (int32_t)lo * xb[b] + (int32_t)hi * xb[4 + b];
                        }
                    }
                }
                group_update(t, p, g, r, acc, facc);
            }
            memcpy(t->out + (size_t)r * t->ldo + p * PANEL, facc, sizeof(float) * ncols);
        }
    }
}

#ifdef QM_X86

/* ---- AVX-512 VNNI: one zmm = the 16 columns of a panel; RB rows share each weight vector ---- */

#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))

/* The high-bit word's bits at `from` moved to bit `to` (constants once unrolled). */
static inline AVX512_TARGET __attribute__((always_inline)) __m512i move_bits512(__m512i h, const int from, const int to) {
    return from >= to ? _mm512_srli_epi32(h, from - to) : _mm512_slli_epi32(h, to - from);
}

/* The high-bit word shifted so that the bits at `s` land at bit 4. */
static inline AVX512_TARGET __attribute__((always_inline)) __m512i hi_at4_512(__m512i h, const int s) {
    return move_bits512(h, s, 4);
}

/* 16 scales (float16 or float32) from index i of a: load_scale for a whole panel. */
static inline AVX512_TARGET __attribute__((always_inline)) __m512 load_scales512(const void *a, size_t i, int f16) {
    return f16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)a + i)))
               : _mm512_loadu_ps((const float *)a + i);
}

/* The scale s and bias b of group g for the 16 columns of panel p (avx2_group_scales on a whole panel). */
static inline AVX512_TARGET __attribute__((always_inline)) void
avx512_group_scales(const Task *t, int p, int g, __m512 *s, __m512 *b) {
    const int K = t->K, G = t->group;
    const size_t so = ((size_t)p * (K / G) + g) * PANEL;
    if (t->kq) {
        const size_t dofs = ((size_t)p * (K / 256) + g * G / 256) * PANEL;
        const __m512 dd = load_scales512(t->scales, dofs, t->f16), dm = load_scales512(t->biases, dofs, t->f16);
        *s = _mm512_mul_ps(dd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(t->ksc + so)))));
        *b = _mm512_mul_ps(dm, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(t->km + so)))));
    } else {
        *s = load_scales512(t->scales, so, t->f16);
        *b = t->biases ? load_scales512(t->biases, so, t->f16) : *s;
    }
}

/* HB: the segment's high bits (0, or 1 / 2 for K-quants), a constant per instance. With high bits a
   group's are one word (32 x 1 bit for Q5_K, 16 x 2 bits for Q6_K), so its shifts are constants. */
static inline AVX512_TARGET __attribute__((always_inline)) void
avx512_rows(const Task *t, int p, int r0, const int RB, const int HB) {
    const int K = t->K, G = t->group, ng = K / G, bits = t->bits, epw = 32 / bits, wpg = G / epw;
    const uint32_t *wp = t->w + (size_t)p * (K / epw) * PANEL;
    const uint32_t *hp = HB ? t->hw + (size_t)p * (K * HB / 32) * PANEL : NULL;
    /* vpternlogd 0xf8: a | (b & c) */
    const __m512i hm4 = _mm512_set1_epi32(HB == 1 ? 0x00100010 : 0x00300030);
    __m512 facc[8];
    for (int r = 0; r < RB; r++) facc[r] = _mm512_setzero_ps();
    const __m512i m4 = _mm512_set1_epi32(0x000f000f), m8 = _mm512_set1_epi32(0x00ff00ff);
    /* Independent accumulators per row so that consecutive vpdpwssd do not wait on each other's
       latency: 4 for a GEMV (else one dependency chain), fewer as rows add chains, 1 from 5 rows
       on (8 rows x 2 spilled registers and ran ~1.5x slower). */
    const int NA = RB <= 2 ? 4 : RB <= 4 ? 2 : 1;
    for (int g = 0; g < ng; g++) {
        __m512i acc[8][4];
        for (int r = 0; r < RB; r++)
            for (int a = 0; a < NA; a++) acc[r][a] = _mm512_setzero_si512();
        const uint32_t *wg = wp + (size_t)g * wpg * PANEL;
        const int32_t *xg = (const int32_t *)(t->xq + (size_t)r0 * K) + g * G / 2;
        const int xstride = K / 2;
        if (HB) {
            const __m512i h = _mm512_loadu_si512(hp + (size_t)g * PANEL);
#pragma GCC unroll 4
            for (int j = 0; j < 4 / HB; j++) {
                PREFETCH(wg + j * PANEL);
                __m512i v = _mm512_loadu_si512(wg + j * PANEL);
                __m512i w0 = _mm512_ternarylogic_epi32(_mm512_and_si512(v, m4), hi_at4_512(h, HB * 4 * j), hm4, 0xf8);
                __m512i w1 = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi32(v, 4), m4),
                                                       hi_at4_512(h, HB * (4 * j + 1)), hm4, 0xf8);
                __m512i w2 = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi32(v, 8), m4),
                                                       hi_at4_512(h, HB * (4 * j + 2)), hm4, 0xf8);
                __m512i w3 = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi32(v, 12), m4),
                                                       hi_at4_512(h, HB * (4 * j + 3)), hm4, 0xf8);
                for (int r = 0; r < RB; r++) {
                    const int32_t *x = xg + r * xstride + 4 * j;
                    acc[r][0] = _mm512_dpwssd_epi32(acc[r][0], w0, _mm512_set1_epi32(x[0]));
                    acc[r][1 % NA] = _mm512_dpwssd_epi32(acc[r][1 % NA], w1, _mm512_set1_epi32(x[1]));
                    acc[r][2 % NA] = _mm512_dpwssd_epi32(acc[r][2 % NA], w2, _mm512_set1_epi32(x[2]));
                    acc[r][3 % NA] = _mm512_dpwssd_epi32(acc[r][3 % NA], w3, _mm512_set1_epi32(x[3]));
                }
            }
        } else if (bits == 4) {
            for (int j = 0; j < wpg; j++) {
                PREFETCH(wg + j * PANEL);
                __m512i v = _mm512_loadu_si512(wg + j * PANEL);
                __m512i w0 = _mm512_and_si512(v, m4);
                __m512i w1 = _mm512_and_si512(_mm512_srli_epi32(v, 4), m4);
                __m512i w2 = _mm512_and_si512(_mm512_srli_epi32(v, 8), m4);
                __m512i w3 = _mm512_and_si512(_mm512_srli_epi32(v, 12), m4);
                for (int r = 0; r < RB; r++) {
                    const int32_t *x = xg + r * xstride + 4 * j;
                    acc[r][0] = _mm512_dpwssd_epi32(acc[r][0], w0, _mm512_set1_epi32(x[0]));
                    acc[r][1 % NA] = _mm512_dpwssd_epi32(acc[r][1 % NA], w1, _mm512_set1_epi32(x[1]));
                    acc[r][2 % NA] = _mm512_dpwssd_epi32(acc[r][2 % NA], w2, _mm512_set1_epi32(x[2]));
                    acc[r][3 % NA] = _mm512_dpwssd_epi32(acc[r][3 % NA], w3, _mm512_set1_epi32(x[3]));
                }
            }
        } else {
            for (int j = 0; j < wpg; j++) {
                PREFETCH(wg + j * PANEL);
                __m512i v = _mm512_loadu_si512(wg + j * PANEL);
                __m512i w0 = _mm512_and_si512(v, m8);
                __m512i w1 = _mm512_and_si512(_mm512_srli_epi32(v, 8), m8);
                const int a = 2 * (j & 1) % NA, b = (2 * (j & 1) + 1) % NA;
                for (int r = 0; r < RB; r++) {
                    const int32_t *x = xg + r * xstride + 2 * j;
                    acc[r][a] = _mm512_dpwssd_epi32(acc[r][a], w0, _mm512_set1_epi32(x[0]));
                    acc[r][b] = _mm512_dpwssd_epi32(acc[r][b], w1, _mm512_set1_epi32(x[1]));
                }
            }
        }
        for (int r = 0; r < RB; r++)
            for (int a = 1; a < NA; a++) acc[r][0] = _mm512_add_epi32(acc[r][0], acc[r][a]);
        __m512 s, b;
        avx512_group_scales(t, p, g, &s, &b);
        for (int r = 0; r < RB; r++) {
            size_t xi = (size_t)(r0 + r) * ng + g;
            facc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][0]), _mm512_mul_ps(s, _mm512_set1_ps(t->xd[xi])), facc[r]);
            facc[r] = _mm512_fmadd_ps(b, _mm512_set1_ps(t->xs[xi]), facc[r]);
        }
    }
    int ncols = t->N - p * PANEL;
    __mmask16 mask = ncols >= PANEL ? (__mmask16)0xffff : (__mmask16)((1u << ncols) - 1);
    for (int r = 0; r < RB; r++) _mm512_mask_storeu_ps(t->out + (size_t)(r0 + r) * t->ldo + p * PANEL, mask, facc[r]);
}

static inline AVX512_TARGET __attribute__((always_inline)) void
avx512_panel(const Task *t, int p, int r0, int r1, const int HB) {
    int r = r0;
    for (; r + 8 <= r1; r += 8) avx512_rows(t, p, r, 8, HB);
    switch (r1 - r) {
    case 7: avx512_rows(t, p, r, 7, HB); break;
    case 6: avx512_rows(t, p, r, 6, HB); break;
    case 5: avx512_rows(t, p, r, 5, HB); break;
    case 4: avx512_rows(t, p, r, 4, HB); break;
    case 3: avx512_rows(t, p, r, 3, HB); break;
    case 2: avx512_rows(t, p, r, 2, HB); break;
    case 1: avx512_rows(t, p, r, 1, HB); break;
    default: break;
    }
}

static AVX512_TARGET void kernel_avx512(const Task *t, int p0, int p1, int r0, int r1) {
    for (int p = p0; p < p1; p++) {
        if (t->hbits == 1) avx512_panel(t, p, r0, r1, 1);
        else if (t->hbits == 2) avx512_panel(t, p, r0, r1, 2);
        else avx512_panel(t, p, r0, r1, 0);
    }
}

/* ---- AVX2: two ymm per panel, vpmaddwd + vpaddd; 4 rows share each weight vector ---- */

#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))

/* 8 scales (float16 or float32) from index i of a: load_scale for half a panel. */
static inline AVX2_TARGET __attribute__((always_inline)) __m256 load_scales256(const void *a, size_t i, int f16) {
    return f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)a + i)))
               : _mm256_loadu_ps((const float *)a + i);
}

/* The scale s and bias b of group g for half h (8 columns) of panel p; K-quants multiply their int8
   group scales and mins by the super-block's d and dmin. */
static inline AVX2_TARGET __attribute__((always_inline)) void
avx2_group_scales(const Task *t, int p, int g, int h, __m256 *s, __m256 *b) {
    const int K = t->K, G = t->group;
    size_t so = ((size_t)p * (K / G) + g) * PANEL + 8 * h;
    if (t->kq) {
        size_t dofs = ((size_t)p * (K / 256) + g * G / 256) * PANEL + 8 * h;
        const __m256 dd = load_scales256(t->scales, dofs, t->f16), dm = load_scales256(t->biases, dofs, t->f16);
        *s = _mm256_mul_ps(dd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(t->ksc + so)))));
        *b = _mm256_mul_ps(dm, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(t->km + so)))));
    } else {
        *s = load_scales256(t->scales, so, t->f16);
        *b = t->biases ? load_scales256(t->biases, so, t->f16) : *s;
    }
}

static inline AVX2_TARGET __attribute__((always_inline)) __m256i madd_acc(__m256i acc, __m256i w, int32_t x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(w, _mm256_set1_epi32(x)));
}

static inline AVX2_TARGET __attribute__((always_inline)) __m256i hi4_256(__m256i lo, __m256i h, const int s, __m256i hm4) {
    __m256i a = s >= 4 ? _mm256_srli_epi32(h, s - 4) : _mm256_slli_epi32(h, 4 - s);
    return _mm256_or_si256(lo, _mm256_and_si256(a, hm4));
}

/* HB as in avx512_rows. */
static inline AVX2_TARGET __attribute__((always_inline)) void
avx2_rows(const Task *t, int p, int r0, const int RB, const int HB) {
    const int K = t->K, G = t->group, ng = K / G, bits = t->bits, epw = 32 / bits, wpg = G / epw;
    const uint32_t *wp = t->w + (size_t)p * (K / epw) * PANEL;
    const uint32_t *hp = HB ? t->hw + (size_t)p * (K * HB / 32) * PANEL : NULL;
    const __m256i hm4 = _mm256_set1_epi32(HB == 1 ? 0x00100010 : 0x00300030);
    __m256 facc[4][2];
    for (int r = 0; r < RB; r++) facc[r][0] = facc[r][1] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi32(0x000f000f), m8 = _mm256_set1_epi32(0x00ff00ff);
    for (int g = 0; g < ng; g++) {
        __m256i acc[4][2];
        for (int r = 0; r < RB; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
        const uint32_t *wg = wp + (size_t)g * wpg * PANEL;
        const int32_t *xg = (const int32_t *)(t->xq + (size_t)r0 * K) + g * G / 2;
        const int xstride = K / 2;
        if (HB) {
            for (int h = 0; h < 2; h++) {
                const __m256i hw = _mm256_loadu_si256((const __m256i *)(hp + (size_t)g * PANEL + 8 * h));
#pragma GCC unroll 4
                for (int j = 0; j < 4 / HB; j++) {
                    if (!h) PREFETCH(wg + j * PANEL);
                    __m256i v = _mm256_loadu_si256((const __m256i *)(wg + j * PANEL + 8 * h));
                    __m256i w0 = hi4_256(_mm256_and_si256(v, m4), hw, HB * 4 * j, hm4);
                    __m256i w1 = hi4_256(_mm256_and_si256(_mm256_srli_epi32(v, 4), m4), hw, HB * (4 * j + 1), hm4);
                    __m256i w2 = hi4_256(_mm256_and_si256(_mm256_srli_epi32(v, 8), m4), hw, HB * (4 * j + 2), hm4);
                    __m256i w3 = hi4_256(_mm256_and_si256(_mm256_srli_epi32(v, 12), m4), hw, HB * (4 * j + 3), hm4);
                    for (int r = 0; r < RB; r++) {
                        const int32_t *x = xg + r * xstride + 4 * j;
                        __m256i a = madd_acc(acc[r][h], w0, x[0]);
                        a = madd_acc(a, w1, x[1]);
                        a = madd_acc(a, w2, x[2]);
                        acc[r][h] = madd_acc(a, w3, x[3]);
                    }
                }
            }
        } else for (int j = 0; j < wpg; j++) {
            PREFETCH(wg + j * PANEL);
            for (int h = 0; h < 2; h++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(wg + j * PANEL + 8 * h));
                if (bits == 4) {
                    __m256i w0 = _mm256_and_si256(v, m4);
                    __m256i w1 = _mm256_and_si256(_mm256_srli_epi32(v, 4), m4);
                    __m256i w2 = _mm256_and_si256(_mm256_srli_epi32(v, 8), m4);
                    __m256i w3 = _mm256_and_si256(_mm256_srli_epi32(v, 12), m4);
                    for (int r = 0; r < RB; r++) {
                        const int32_t *x = xg + r * xstride + 4 * j;
                        __m256i a = madd_acc(acc[r][h], w0, x[0]);
                        a = madd_acc(a, w1, x[1]);
                        a = madd_acc(a, w2, x[2]);
                        acc[r][h] = madd_acc(a, w3, x[3]);
                    }
                } else {
                    __m256i w0 = _mm256_and_si256(v, m8);
                    __m256i w1 = _mm256_and_si256(_mm256_srli_epi32(v, 8), m8);
                    for (int r = 0; r < RB; r++) {
                        const int32_t *x = xg + r * xstride + 2 * j;
                        acc[r][h] = madd_acc(madd_acc(acc[r][h], w0, x[0]), w1, x[1]);
                    }
                }
            }
        }
        for (int h = 0; h < 2; h++) {
            __m256 s, b;
            avx2_group_scales(t, p, g, h, &s, &b);
            for (int r = 0; r < RB; r++) {
                size_t xi = (size_t)(r0 + r) * ng + g;
                __m256 f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][h]), _mm256_mul_ps(s, _mm256_set1_ps(t->xd[xi])),
                                           facc[r][h]);
                facc[r][h] = _mm256_fmadd_ps(b, _mm256_set1_ps(t->xs[xi]), f);
            }
        }
    }
    int ncols = t->N - p * PANEL;
    for (int r = 0; r < RB; r++) {
        float *o = t->out + (size_t)(r0 + r) * t->ldo + p * PANEL;
        if (ncols >= PANEL) {
            _mm256_storeu_ps(o, facc[r][0]);
            _mm256_storeu_ps(o + 8, facc[r][1]);
        } else {
            float tmp[PANEL];
            _mm256_storeu_ps(tmp, facc[r][0]);
            _mm256_storeu_ps(tmp + 8, facc[r][1]);
            memcpy(o, tmp, sizeof(float) * ncols);
        }
    }
}

static inline AVX2_TARGET __attribute__((always_inline)) void
avx2_panel(const Task *t, int p, int r0, int r1, const int HB) {
    int r = r0;
    for (; r + 4 <= r1; r += 4) avx2_rows(t, p, r, 4, HB);
    switch (r1 - r) {
    case 3: avx2_rows(t, p, r, 3, HB); break;
    case 2: avx2_rows(t, p, r, 2, HB); break;
    case 1: avx2_rows(t, p, r, 1, HB); break;
    default: break;
    }
}

static AVX2_TARGET void kernel_avx2(const Task *t, int p0, int p1, int r0, int r1) {
    for (int p = p0; p < p1; p++) {
        if (t->hbits == 1) avx2_panel(t, p, r0, r1, 1);
        else if (t->hbits == 2) avx2_panel(t, p, r0, r1, 2);
        else avx2_panel(t, p, r0, r1, 0);
    }
}
/* ---- AVX2 with int8 activations: vpmaddubsw of unsigned weights and int8 activations, then
   vpmaddwd with ones into int32 (the way of llama.cpp's q4_0 x q8_0 dot). A 4-bit word gives two
   vectors of bytes (low and high nibbles) against two broadcast words of activations; a row's
   int16 sums take up to FL words before vpmaddwd (each vpmaddubsw lane is at most
   2 * (2^bits - 1) * 127: 3810 for 4 bits, so 8 of them stay below 2^15). 8-bit weights are
   flipped to signed (w - 128) and multiplied as |w - 128| by x carrying w - 128's sign (vpsignb;
   2 * 128 * 127 fits int16), and 128 * sum(x) is added back per group. Two rows share each
   unpacked weight vector; in the common layouts, with four rows or more, four rows, and each
   broadcast activation word serves 16 columns (avx2_tile4). ---- */

static inline AVX2_TARGET __attribute__((always_inline)) __m256i bcast32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* The high-bit word's bits at `from` moved to bit `to` (constants once unrolled). */
static inline AVX2_TARGET __attribute__((always_inline)) __m256i move_bits(__m256i h, const int from, const int to) {
    return from >= to ? _mm256_srli_epi32(h, from - to) : _mm256_slli_epi32(h, to - from);
}

/* Word j of a group as bytes: lo its low nibbles, hi its high ones, each with its HB high bits (from the
   group's high-bit word hw) placed above the nibble. */
static inline AVX2_TARGET __attribute__((always_inline)) void
avx2_nibbles(__m256i v, __m256i hw, const int j, const int HB, __m256i *lo, __m256i *hi) {
    const __m256i m0f = _mm256_set1_epi8(0x0f);
    /* the high bits of bytes 0 and 2 (at bit 4 of each int16 half), and of bytes 1 and 3 */
    const __m256i hmA = _mm256_set1_epi32(HB == 1 ? 0x00100010 : 0x00300030);
    const __m256i hmB = _mm256_set1_epi32(HB == 1 ? 0x10001000 : 0x30003000);
    *lo = _mm256_and_si256(v, m0f);
    *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m0f);
    if (HB) {
        const int hb0 = HB * 4 * j;
        *lo = _mm256_or_si256(*lo, _mm256_or_si256(_mm256_and_si256(move_bits(hw, hb0, 4), hmA),
                                                   _mm256_and_si256(move_bits(hw, hb0 + 2 * HB, 12), hmB)));
        *hi = _mm256_or_si256(*hi, _mm256_or_si256(_mm256_and_si256(move_bits(hw, hb0 + HB, 4), hmA),
                                                   _mm256_and_si256(move_bits(hw, hb0 + 3 * HB, 12), hmB)));
    }
}

/* One row block's group g of 8 columns (half h of the panel): the rows' int32 dots in acc. */
static inline AVX2_TARGET __attribute__((always_inline)) void
avx2_group8(const Task *t, const uint32_t *wp, const uint32_t *hp, int g, int h, const int8_t *xg, __m256i *acc,
            const int RB, const int HB, const int BITS, const int GC) {
    const int K = t->K, G = GC ? GC : t->group, epw = 32 / BITS, wpg = G / epw;
    const int FL = BITS == 8 ? 1 : HB == 0 ? 4 : HB == 1 ? 2 : 1;
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    const uint32_t *wg = wp + (size_t)g * wpg * PANEL + 8 * h;
    __m256i s16[2] = {0};
    for (int r = 0; r < RB; r++) acc[r] = _mm256_setzero_si256();
    const __m256i hw = HB ? _mm256_loadu_si256((const __m256i *)(hp + (size_t)g * PANEL + 8 * h)) : _mm256_setzero_si256();
    for (int j = 0; j < wpg; j++) {
        if (!h) PREFETCH(wg + j * PANEL);
        const __m256i v = _mm256_loadu_si256((const __m256i *)(wg + j * PANEL));
        if (BITS == 8) {
            const __m256i sw = _mm256_xor_si256(v, flip), aw = _mm256_abs_epi8(sw);
            for (int r = 0; r < RB; r++) {
                __m256i d = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(bcast32(xg + (size_t)r * K + 4 * j), sw));
                acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(d, ones));
            }
            continue;
        }
        __m256i lo, hi;
        avx2_nibbles(v, hw, j, HB, &lo, &hi);
        for (int r = 0; r < RB; r++) {
            const int8_t *x = xg + (size_t)r * K + 8 * j;
            __m256i d = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast32(x)), _mm256_maddubs_epi16(hi, bcast32(x + 4)));
            s16[r] = j % FL ? _mm256_add_epi16(s16[r], d) : d;
            if (j % FL == FL - 1 || j == wpg - 1) acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(s16[r], ones));
        }
    }
}

/* facc[r] += the group's dots acc[r] scaled, for half h of panel p: s * d_x * acc + b * sum(x). */
static inline AVX2_TARGET __attribute__((always_inline)) void
avx2_scale8(const Task *t, int p, int g, int h, int r0, const __m256i *acc, __m256 *facc, const int RB, const int BITS) {
    const int K = t->K, G = t->group, ng = K / G;
    __m256 s, b;
    avx2_group_scales(t, p, g, h, &s, &b);
    for (int r = 0; r < RB; r++) {
        size_t xi = (size_t)(r0 + r) * ng + g;
        __m256i a = BITS == 8 ? _mm256_add_epi32(acc[r], _mm256_set1_epi32(128 * t->xi[xi])) : acc[r];
        __m256 f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_mul_ps(s, _mm256_set1_ps(t->xd[xi])), facc[r]);
        facc[r] = _mm256_fmadd_ps(b, _mm256_set1_ps(t->xs[xi]), f);
    }
}

/* Rows r0..r0+RB-1 (RB <= 2) of panel p: a group's two halves in turn, so that a weight line's
   second half is read while it is still in L1; 2 rows x 2 halves of accumulators stay in registers. */
static inline AVX2_TARGET __attribute__((always_inline)) void
avx2_rows8(const Task *t, int p, int r0, const int RB, const int HB, const int BITS, const int GC) {
    const int K = t->K, G = GC ? GC : t->group, ng = K / G;
    const uint32_t *wp = t->w + (size_t)p * (K / (32 / BITS)) * PANEL;
    const uint32_t *hp = HB ? t->hw + (size_t)p * (K * HB / 32) * PANEL : NULL;
    const int8_t *xg0 = t->x8 + (size_t)r0 * K;
    const int ncols = t->N - p * PANEL;
    __m256 facc[2][2];
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < RB; r++) facc[h][r] = _mm256_setzero_ps();
    for (int g = 0; g < ng; g++) {
        __m256i acc[2][2];
        for (int h = 0; h < 2; h++) avx2_group8(t, wp, hp, g, h, xg0 + (size_t)g * G, acc[h], RB, HB, BITS, GC);
        for (int h = 0; h < 2; h++) avx2_scale8(t, p, g, h, r0, acc[h], facc[h], RB, BITS);
    }
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < RB; r++) {
            float *o = t->out + (size_t)(r0 + r) * t->ldo + p * PANEL + 8 * h;
            const int n = ncols - 8 * h;
            if (n >= 8) {
                _mm256_storeu_ps(o, facc[h][r]);
            } else if (n > 0) {
                float tmp[8];
                _mm256_storeu_ps(tmp, facc[h][r]);
                memcpy(o, tmp, sizeof(float) * n);
            }
        }
}

static inline AVX2_TARGET __attribute__((always_inline)) void
avx2_panel8(const Task *t, int p, int r0, int r1, const int HB, const int BITS) {
    int r = r0;
    if (t->group == 32) {
        for (; r + 2 <= r1; r += 2) avx2_rows8(t, p, r, 2, HB, BITS, 32);
        if (r < r1) avx2_rows8(t, p, r, 1, HB, BITS, 32);
        return;
    }
    for (; r + 2 <= r1; r += 2) avx2_rows8(t, p, r, 2, HB, BITS, 0);
    if (r < r1) avx2_rows8(t, p, r, 1, HB, BITS, 0);
}

/* Rows r0..r0+RB-1 of out's half h of panel p = facc, the panel's last columns cut at N. */
static inline AVX2_TARGET __attribute__((always_inline)) void
avx2_store_half(const Task *t, int p, int h, int r0, const __m256 *facc, const int RB) {
    const int n = t->N - p * PANEL - 8 * h;
    for (int r = 0; r < RB; r++) {
        float *o = t->out + (size_t)(r0 + r) * t->ldo + p * PANEL + 8 * h;
        if (n >= 8) {
            _mm256_storeu_ps(o, facc[r]);
        } else if (n > 0) {
            float tmp[8];
            _mm256_storeu_ps(tmp, facc[r]);
            memcpy(o, tmp, sizeof(float) * n);
        }
    }
}

/* Rows r0..r0+RB-1 (RB <= 4) of panel p, both halves at once, every trip count a constant so the
   rows' sums live in registers: the batch and prompt path, where each unpacked weight vector serves
   four rows and each broadcast activation word 16 columns. Three layouts: 4-bit in groups of 32
   (Q4_0, Q4_1, Q4_K; a group's eight vpmaddubsw sums stay int16), 4-bit with two high bits in
   groups of 16 (Q6_K) and 8-bit in groups of 32 (Q8_0), whose sums go to int32 after every word.
   The float accumulators wait in memory, read and written once a group. */
static inline AVX2_TARGET __attribute__((always_inline)) void
avx2_tile4(const Task *t, int p, int r0, const int RB, const int BITS, const int HB, const int G) {
    const int K = t->K, ng = K / G, epw = 32 / BITS, wpg = G / epw, WIDE = BITS == 8 || HB;
    const uint32_t *wp = t->w + (size_t)p * (K / epw) * PANEL;
    const uint32_t *hp = HB ? t->hw + (size_t)p * (K * HB / 32) * PANEL : NULL;
    const int8_t *x = t->x8 + (size_t)r0 * K;
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    __m256 facc[2][4];
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < RB; r++) facc[h][r] = _mm256_setzero_ps();
    for (int g = 0; g < ng; g++) {
        const uint32_t *wg = wp + (size_t)g * wpg * PANEL;
        __m256i hw[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        if (HB)
            for (int h = 0; h < 2; h++) hw[h] = _mm256_loadu_si256((const __m256i *)(hp + (size_t)g * PANEL + 8 * h));
        __m256i sum[2][4];
#pragma GCC unroll 8
        for (int j = 0; j < wpg; j++) {
            __m256i lo[2], hi[2];
            for (int h = 0; h < 2; h++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(wg + j * PANEL + 8 * h));
                if (BITS == 8) {
                    hi[h] = _mm256_xor_si256(v, flip); /* the signed weights; lo: their magnitudes */
                    lo[h] = _mm256_abs_epi8(hi[h]);
                } else {
                    avx2_nibbles(v, hw[h], j, HB, &lo[h], &hi[h]);
                }
            }
#pragma GCC unroll 4
            for (int r = 0; r < RB; r++) {
                const int8_t *xr = x + (size_t)r * K + g * G + (BITS == 8 ? 4 : 8) * j;
                const __m256i b0 = bcast32(xr);
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {
                    __m256i d;
                    if (BITS == 8) {
                        d = _mm256_madd_epi16(_mm256_maddubs_epi16(lo[h], _mm256_sign_epi8(b0, hi[h])), ones);
                        sum[h][r] = j ? _mm256_add_epi32(sum[h][r], d) : d;
                    } else if (WIDE) {
                        d = _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], b0), _mm256_maddubs_epi16(hi[h], bcast32(xr + 4)));
                        d = _mm256_madd_epi16(d, ones);
                        sum[h][r] = j ? _mm256_add_epi32(sum[h][r], d) : d;
                    } else {
                        d = _mm256_maddubs_epi16(lo[h], b0);
                        if (j) d = _mm256_add_epi16(sum[h][r], d);
                        sum[h][r] = _mm256_add_epi16(d, _mm256_maddubs_epi16(hi[h], bcast32(xr + 4)));
                    }
                }
                /* keeps gcc from regrouping the sums into a tree whose leaves spill */
                __asm__("" : "+x"(sum[0][r]), "+x"(sum[1][r]));
            }
        }
        __m256 s[2], b[2];
        for (int h = 0; h < 2; h++) avx2_group_scales(t, p, g, h, &s[h], &b[h]);
#pragma GCC unroll 4
        for (int r = 0; r < RB; r++) {
            const size_t xi = (size_t)(r0 + r) * ng + g;
            const __m256 xd = _mm256_set1_ps(t->xd[xi]), xs = _mm256_set1_ps(t->xs[xi]);
            const __m256i x128 = _mm256_set1_epi32(BITS == 8 ? 128 * t->xi[xi] : 0);
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                __m256i a = WIDE ? sum[h][r] : _mm256_madd_epi16(sum[h][r], ones);
                if (BITS == 8) a = _mm256_add_epi32(a, x128);
                const __m256 f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_mul_ps(s[h], xd), facc[h][r]);
                facc[h][r] = _mm256_fmadd_ps(b[h], xs, f);
            }
        }
    }
    for (int h = 0; h < 2; h++) avx2_store_half(t, p, h, r0, facc[h], RB);
}

/* Panel p's rows r0..r1 (at least 4) four at a time. */
static inline AVX2_TARGET __attribute__((always_inline)) void
avx2_panel4(const Task *t, int p, int r0, int r1, const int BITS, const int HB, const int G) {
    int r = r0;
    for (; r + 4 <= r1; r += 4) avx2_tile4(t, p, r, 4, BITS, HB, G);
    switch (r1 - r) {
    case 3: avx2_tile4(t, p, r, 3, BITS, HB, G); break;
    case 2: avx2_tile4(t, p, r, 2, BITS, HB, G); break;
    case 1: avx2_tile4(t, p, r, 1, BITS, HB, G); break;
    default: break;
    }
}

/* Each layout's own function, so that its loops get the registers to themselves. */
static AVX2_TARGET __attribute__((noinline)) void avx2_panel4_q4(const Task *t, int p, int r0, int r1) {
    avx2_panel4(t, p, r0, r1, 4, 0, 32);
}
static AVX2_TARGET __attribute__((noinline)) void avx2_panel4_q6k(const Task *t, int p, int r0, int r1) {
    avx2_panel4(t, p, r0, r1, 4, 2, 16);
}
static AVX2_TARGET __attribute__((noinline)) void avx2_panel4_q8(const Task *t, int p, int r0, int r1) {
    avx2_panel4(t, p, r0, r1, 8, 0, 32);
}

/* Group g's int8 values v [panels, K / group, 16] of half h as int16 pairs: (v[g], v[g]) per int32 lane,
   or with `next` (v[g], v[g + 1]). */
static inline AVX2_TARGET __attribute__((always_inline)) __m256i
int16_pairs(const int8_t *v, size_t at, int next) {
    const __m128i a = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(v + at)));
    const __m128i b = next ? _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(v + at + PANEL))) : a;
    return _mm256_set_m128i(_mm_unpackhi_epi16(a, b), _mm_unpacklo_epi16(a, b));
}

/* Half h of super-block sbk for rows r0..r0+RB-1: facc[r] += d * d_x * acc[r] + dmin * d_x * sum(m * x),
   the mins' sums from the integer activation sums of the groups, two groups a vpmaddwd. */
static inline AVX2_TARGET __attribute__((always_inline)) void
avx2_super_block_end(const Task *t, int p, int h, int sbk, int r0, const __m256i *acc, __m256 *facc, const int RB,
                     const int G) {
    const int ng = t->K / G, nsb = t->K / 256;
    const size_t dofs = ((size_t)p * nsb + sbk) * PANEL + 8 * h;
    const __m256 dd = load_scales256(t->scales, dofs, t->f16), dm = load_scales256(t->biases, dofs, t->f16);
    __m256i mins[8];
    for (int r = 0; r < RB; r++) mins[r] = _mm256_setzero_si256();
    for (int g = sbk * (256 / G); g < (sbk + 1) * (256 / G); g += 2) {
        const __m256i m = int16_pairs(t->km, ((size_t)p * ng + g) * PANEL + 8 * h, 1);
        for (int r = 0; r < RB; r++) {
            const __m256i pair = bcast32((const int8_t *)(t->xi16 + (size_t)(r0 + r) * ng + g));
            mins[r] = _mm256_add_epi32(mins[r], _mm256_madd_epi16(m, pair));
        }
    }
    for (int r = 0; r < RB; r++) {
        const __m256 xd = _mm256_set1_ps(t->xd[(size_t)(r0 + r) * nsb + sbk]);
        const __m256 f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]), _mm256_mul_ps(dd, xd), facc[r]);
        facc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins[r]), _mm256_mul_ps(dm, xd), f);
    }
}

/* Rows r0..r0+RB-1 of panel p for the K-quants with super-block activations (one int8
   scale per 256 values of a row, as llama.cpp's Q8_K), Q4_K (HB 0) and Q5_K (HB 1), groups of 32: a
   group's int16 sums are weighted by its int8 scales in the vpmaddwd that widens them (in place of
   ones), after four words (4 bits) or two (5 bits: four words' sums could overflow int16), and summed
   in int32 over the super-block; the mins' term comes from the groups' integer activation sums, and
   the floats are touched once a super-block instead of once a group.
   |sum| < 8 groups * 32 * 31 * 127 * 63 < 2^31. */
static inline AVX2_TARGET __attribute__((always_inline)) void
avx2_tile_sb(const Task *t, int p, int r0, const int RB, const int HB) {
    const int K = t->K, G = 32, ng = K / G, nsb = K / 256, FL = HB ? 2 : 4;
    const uint32_t *wp = t->w + (size_t)p * (K / 8) * PANEL;
    const uint32_t *hp = HB ? t->hw + (size_t)p * (K / 32) * PANEL : NULL;
    __m256 facc[2][4];
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < RB; r++) facc[h][r] = _mm256_setzero_ps();
    for (int sbk = 0; sbk < nsb; sbk++) {
        __m256i acc[2][4];
        for (int h = 0; h < 2; h++)
            for (int r = 0; r < RB; r++) acc[h][r] = _mm256_setzero_si256();
        for (int g = sbk * 8; g < sbk * 8 + 8; g++) {
            const uint32_t *wg = wp + (size_t)g * 4 * PANEL;
            __m256i hw[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}, sc[2], sum[2][4];
            for (int h = 0; h < 2; h++) {
                sc[h] = int16_pairs(t->ksc, ((size_t)p * ng + g) * PANEL + 8 * h, 0);
                if (HB) hw[h] = _mm256_loadu_si256((const __m256i *)(hp + (size_t)g * PANEL + 8 * h));
            }
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                __m256i lo[2], hi[2];
                PREFETCH(wg + j * PANEL);
                for (int h = 0; h < 2; h++)
                    avx2_nibbles(_mm256_loadu_si256((const __m256i *)(wg + j * PANEL + 8 * h)), hw[h], j, HB, &lo[h], &hi[h]);
#pragma GCC unroll 4
                for (int r = 0; r < RB; r++) {
                    const int8_t *xr = sb_x(t, r0 + r, g * G + 8 * j);
                    const __m256i b0 = bcast32(xr), b1 = bcast32(xr + 4);
#pragma GCC unroll 2
                    for (int h = 0; h < 2; h++) {
                        __m256i d = _mm256_maddubs_epi16(lo[h], b0);
                        if (j % FL) d = _mm256_add_epi16(sum[h][r], d);
                        sum[h][r] = _mm256_add_epi16(d, _mm256_maddubs_epi16(hi[h], b1));
                        if (j % FL == FL - 1) acc[h][r] = _mm256_add_epi32(acc[h][r], _mm256_madd_epi16(sum[h][r], sc[h]));
                    }
                    __asm__("" : "+x"(sum[0][r]), "+x"(sum[1][r]));
                }
            }
        }
        for (int h = 0; h < 2; h++) avx2_super_block_end(t, p, h, sbk, r0, acc[h], facc[h], RB, G);
    }
    for (int h = 0; h < 2; h++) avx2_store_half(t, p, h, r0, facc[h], RB);
}

/* Q6_K's super-block tile (as avx2_tile_sb): eight rows by one half of the panel, so each 6-bit
   unpack (15 vector ops a word) serves eight rows; the half's super-block of weights is still in L1
   when the other half reads it. The integer dots go to int32 every word (two words' int16 sums could
   overflow), weighted by the group's scale in the same vpmaddwd. |sum| < 16 * 16 * 63 * 127 * 128. */
static inline AVX2_TARGET __attribute__((always_inline)) void
avx2_tile_sb6(const Task *t, int p, int r0, const int RB) {
    const int K = t->K, G = 16, ng = K / G, nsb = K / 256;
    const uint32_t *wp = t->w + (size_t)p * (K / 8) * PANEL, *hp = t->hw + (size_t)p * (K / 16) * PANEL;
    __m256 facc[2][8];
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < RB; r++) facc[h][r] = _mm256_setzero_ps();
    for (int sbk = 0; sbk < nsb; sbk++) {
        for (int h = 0; h < 2; h++) {
            __m256i acc[8];
            for (int r = 0; r < RB; r++) acc[r] = _mm256_setzero_si256();
            for (int g = sbk * 16; g < sbk * 16 + 16; g++) {
                const __m256i sc = int16_pairs(t->ksc, ((size_t)p * ng + g) * PANEL + 8 * h, 0);
                const __m256i hw = _mm256_loadu_si256((const __m256i *)(hp + (size_t)g * PANEL + 8 * h));
#pragma GCC unroll 2
                for (int j = 0; j < 2; j++) {
                    __m256i lo, hi;
                    if (!h) PREFETCH(wp + (size_t)(2 * g + j) * PANEL);
                    avx2_nibbles(_mm256_loadu_si256((const __m256i *)(wp + (size_t)(2 * g + j) * PANEL + 8 * h)), hw, j, 2,
                                 &lo, &hi);
#pragma GCC unroll 8
                    for (int r = 0; r < RB; r++) {
                        const int8_t *xr = sb_x(t, r0 + r, g * G + 8 * j);
                        const __m256i d = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast32(xr)),
                                                           _mm256_maddubs_epi16(hi, bcast32(xr + 4)));
                        acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(d, sc));
                    }
                }
            }
            avx2_super_block_end(t, p, h, sbk, r0, acc, facc[h], RB, G);
        }
    }
    for (int h = 0; h < 2; h++) avx2_store_half(t, p, h, r0, facc[h], RB);
}

static inline AVX2_TARGET __attribute__((always_inline)) void
avx2_panel_sb(const Task *t, int p, int r0, int r1, const int HB) {
    int r = r0;
    for (; r + 4 <= r1; r += 4) avx2_tile_sb(t, p, r, 4, HB);
    switch (r1 - r) {
    case 3: avx2_tile_sb(t, p, r, 3, HB); break;
    case 2: avx2_tile_sb(t, p, r, 2, HB); break;
    case 1: avx2_tile_sb(t, p, r, 1, HB); break;
    default: break;
    }
}

static AVX2_TARGET __attribute__((noinline)) void avx2_panel_sb_q4k(const Task *t, int p, int r0, int r1) {
    avx2_panel_sb(t, p, r0, r1, 0);
}
static AVX2_TARGET __attribute__((noinline)) void avx2_panel_sb_q5k(const Task *t, int p, int r0, int r1) {
    avx2_panel_sb(t, p, r0, r1, 1);
}
static AVX2_TARGET __attribute__((noinline)) void avx2_panel_sb_q6k(const Task *t, int p, int r0, int r1) {
    int r = r0;
    for (; r + 8 <= r1; r += 8) avx2_tile_sb6(t, p, r, 8);
    switch (r1 - r) {
    case 7: avx2_tile_sb6(t, p, r, 7); break;
    case 6: avx2_tile_sb6(t, p, r, 6); break;
    case 5: avx2_tile_sb6(t, p, r, 5); break;
    case 4: avx2_tile_sb6(t, p, r, 4); break;
    case 3: avx2_tile_sb6(t, p, r, 3); break;
    case 2: avx2_tile_sb6(t, p, r, 2); break;
    case 1: avx2_tile_sb6(t, p, r, 1); break;
    default: break;
    }
}

static AVX2_TARGET void kernel_avx2_8(const Task *t, int p0, int p1, int r0, int r1) {
    const int G = t->group, many = r1 - r0 >= 4;
    for (int p = p0; p < p1; p++) {
        if (t->sb && t->hbits == 2) avx2_panel_sb_q6k(t, p, r0, r1);
        else if (t->sb && t->hbits == 1) avx2_panel_sb_q5k(t, p, r0, r1);
        else if (t->sb) avx2_panel_sb_q4k(t, p, r0, r1);
        else if (many && t->bits == 4 && !t->hbits && G == 32) avx2_panel4_q4(t, p, r0, r1);
        else if (many && t->bits == 4 && t->hbits == 2 && G == 16) avx2_panel4_q6k(t, p, r0, r1);
        else if (many && t->bits == 8 && G == 32) avx2_panel4_q8(t, p, r0, r1);
        else if (t->bits == 8) avx2_panel8(t, p, r0, r1, 0, 8);
        else if (t->hbits == 1) avx2_panel8(t, p, r0, r1, 1, 4);
        else if (t->hbits == 2) avx2_panel8(t, p, r0, r1, 2, 4);
        else avx2_panel8(t, p, r0, r1, 0, 4);
    }
}

/* ---- AVX-512 VNNI with int8 activations: the AVX2 int8 kernels' arithmetic on whole panels ----

One zmm holds a panel's 16 columns, so each unpacked weight vector and each float update serves
twice the columns of a ymm, and vpdpbusd (unsigned weight bytes times signed activation bytes, four
products into each int32 lane) does the work of vpmaddubsw, vpmaddwd and vpaddd. The integer dots
are the AVX2 path's (exact there too) and the floats are updated in the same order, so both paths
give the same bits. 8-bit weights are dotted as the stored unsigned bytes, which is the AVX2 path's
sum(signed weight * x) + 128 * sum(x). Layouts without a kernel here run the AVX2 one. */

/* acc + the dot of w with the 4 bytes (dpbusd) or 2 int16 (dpwssd) at p in every lane, p read as the
   instruction's broadcast operand ({1to16}). gcc 12 loads such a broadcast with a vpbroadcastd of its
   own, an extra instruction beside each vpdpbusd: with it folded in, K-quant matmuls in cache of 4-64 rows
   ran 0-17% faster on one thread (Zen 4; most often 5-10%), the same bits. */
typedef int32_t __attribute__((may_alias, aligned(1))) word32;
static inline AVX512_TARGET __attribute__((always_inline)) __m512i dpbusd_bcast(__m512i acc, __m512i w, const void *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const word32 *)p));
    return acc;
}
static inline AVX512_TARGET __attribute__((always_inline)) __m512i dpwssd_bcast(__m512i acc, __m512i w, const void *p) {
    __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const word32 *)p));
    return acc;
}

/* The high-bit word's pair for each byte of word j's low (HIGH 0) or high (HIGH 1) nibbles at bits 4..4+HB-1 of
   that byte (other bits: others of the word): vpmultishiftqb (AVX-512 VBMI) takes each byte from its own bit
   offset of the lane pair's 64 bits, as avx2_nibbles' shifts place them, a pair's bits at HB * (4j + HIGH) + {0,
   2 HB, 16, 16 + 2 HB} for the lane's bytes 0..3 (+32 in the qword's second lane). Written as asm, so that the
   kernels need not be compiled for VBMI (which CPUs with AVX-512 VNNI may lack: Cascade Lake). */
static inline AVX512_TARGET __attribute__((always_inline)) __m512i high_pairs512(__m512i hw, const int j, const int HB,
                                                                                const int HIGH) {
    const int at[4] = {0, 2 * HB, 16, 16 + 2 * HB}; /* a lane's bytes 0..3 */
    uint64_t control = 0;
    for (int k = 0; k < 8; k++)
        control |= (uint64_t)((32 * (k / 4) + HB * (4 * j + HIGH) + at[k % 4] - 4) & 63) << (8 * k);
    __m512i out;
    __asm__("vpmultishiftqb %2, %1, %0" : "=v"(out) : "v"(_mm512_set1_epi64((long long)control)), "v"(hw));
    return out;
}

/* avx2_nibbles on a whole panel: word j's low and high nibbles as bytes, each with its HB high bits (VBMI: placed
   by high_pairs512, two instructions a vector where the shifts took four). */
static inline AVX512_TARGET __attribute__((always_inline)) void
avx512_nibbles(__m512i v, __m512i hw, const int j, const int HB, const int VBMI, __m512i *lo, __m512i *hi) {
    const __m512i m0f = _mm512_set1_epi8(0x0f);
    *lo = _mm512_and_si512(v, m0f);
    *hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m0f);
    if (HB && VBMI) {
        const __m512i mask = _mm512_set1_epi8(HB == 1 ? 0x10 : 0x30);
        *lo = _mm512_ternarylogic_epi32(*lo, high_pairs512(hw, j, HB, 0), mask, 0xf8);
        *hi = _mm512_ternarylogic_epi32(*hi, high_pairs512(hw, j, HB, 1), mask, 0xf8);
    } else if (HB) {
        const __m512i hmA = _mm512_set1_epi32(HB == 1 ? 0x00100010 : 0x00300030);
        const __m512i hmB = _mm512_set1_epi32(HB == 1 ? 0x10001000 : 0x30003000);
        const int hb0 = HB * 4 * j;
        /* vpternlogd 0xf8: a | (b & c) */
        *lo = _mm512_ternarylogic_epi32(_mm512_ternarylogic_epi32(*lo, move_bits512(hw, hb0, 4), hmA, 0xf8),
                                        move_bits512(hw, hb0 + 2 * HB, 12), hmB, 0xf8);
        *hi = _mm512_ternarylogic_epi32(_mm512_ternarylogic_epi32(*hi, move_bits512(hw, hb0 + HB, 4), hmA, 0xf8),
                                        move_bits512(hw, hb0 + 3 * HB, 12), hmB, 0xf8);
    }
}

/* Rows r0..r0+RB-1 (RB <= 4) of out's panel p = facc, the panel's last columns cut at N. */
static inline AVX512_TARGET __attribute__((always_inline)) void
avx512_store(const Task *t, int p, int r0, const __m512 *facc, const int RB) {
    const int ncols = t->N - p * PANEL;
    const __mmask16 mask = ncols >= PANEL ? (__mmask16)0xffff : (__mmask16)((1u << ncols) - 1);
    for (int r = 0; r < RB; r++) _mm512_mask_storeu_ps(t->out + (size_t)(r0 + r) * t->ldo + p * PANEL, mask, facc[r]);
}

/* Rows r0..r0+RB-1 (RB <= 8) of panel p for weights scaled per group (Q4_0, Q4_1 and 4-bit affine
   groups; Q8_0 and 8-bit ones): a group's dot in int32, then s * d_x * dot + b * sum(x). G: the
   group as a constant, or 0 for t->group. One row keeps two dependency chains (low and high
   nibbles) so that consecutive vpdpbusd do not wait on each other. Eight rows share each unpacked
   word where four did (the registers hold them: 8 accumulators, 8 sums): Q4_0 matmuls of 8-64 rows
   ran 5-17% faster on two threads. */
static inline AVX512_TARGET __attribute__((always_inline)) void
avx512_tile8(const Task *t, int p, int r0, const int RB, const int BITS, const int GC, const int SYM) {
    const int K = t->K, G = GC ? GC : t->group, ng = K / G, epw = 32 / BITS, wpg = G / epw;
    const int NA = RB == 1 && BITS == 4 ? 2 : 1;
    const uint32_t *wp = t->w + (size_t)p * (K / epw) * PANEL;
    const int8_t *x = t->x8 + (size_t)r0 * K;
    const __m512i m0f = _mm512_set1_epi8(0x0f);
    __m512 facc[8];
    for (int r = 0; r < RB; r++) facc[r] = _mm512_setzero_ps();
    for (int g = 0; g < ng; g++) {
        const uint32_t *wg = wp + (size_t)g * wpg * PANEL;
        __m512i acc[8][2];
        for (int r = 0; r < RB; r++)
            for (int a = 0; a < NA; a++) acc[r][a] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int j = 0; j < wpg; j++) {
            PREFETCH(wg + j * PANEL);
            const __m512i v = _mm512_loadu_si512(wg + j * PANEL);
            if (BITS == 8) {
                for (int r = 0; r < RB; r++)
                    acc[r][0] = dpbusd_bcast(acc[r][0], v, x + (size_t)r * K + g * G + 4 * j);
                continue;
            }
            const __m512i lo = _mm512_and_si512(v, m0f), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m0f);
#pragma GCC unroll 8
            for (int r = 0; r < RB; r++) {
                const int8_t *xr = x + (size_t)r * K + g * G + 8 * j;
                acc[r][0] = dpbusd_bcast(acc[r][0], lo, xr);
                acc[r][NA - 1] = dpbusd_bcast(acc[r][NA - 1], hi, xr + 4);
            }
        }
        __m512 s, b;
        if (SYM) /* the bias is the scale (xs holds -center * sum(x)) */
            s = b = load_scales512(t->scales, ((size_t)p * ng + g) * PANEL, t->f16);
        else
            avx512_group_scales(t, p, g, &s, &b);
        for (int r = 0; r < RB; r++) {
            const size_t xi = (size_t)(r0 + r) * ng + g;
            const __m512i a = NA == 2 ? _mm512_add_epi32(acc[r][0], acc[r][1]) : acc[r][0];
            const __m512 f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(s, _mm512_set1_ps(t->xd[xi])), facc[r]);
            facc[r] = _mm512_fmadd_ps(b, _mm512_set1_ps(t->xs[xi]), f);
        }
    }
    avx512_store(t, p, r0, facc, RB);
}

/* What the row tiles of an item share of one super-block (256 k) of panel p: sc each group's int8 scale
   as float lanes, m two groups' mins as int16 pairs, and, for Q5_K and Q6_K when the item has more
   than one tile (PRE; Q4_K from five tiles), w: the weights as bytes ready for vpdpbusd (w[2 * word]
   and w[2 * word + 1] the word's low and high nibbles with their high bits), unpacked once for all the
   tiles. The unpack's shifts run on the port vpdpbusd needs (five a word for Q6_K, one for Q4_K):
   paid once per 64 rows instead of once per 4, Q6_K matmuls of 512 rows ran 1.4-1.5x faster and
   Q4_K's 3-10%; at 16 rows Q4_K's store and reload cost more than the shift. */
typedef struct SuperBlock {
    __m512i w[64], m[8];
    __m512 sc[16];
} SuperBlock;

static inline AVX512_TARGET __attribute__((always_inline)) void
avx512_unpack_sb(const Task *t, int p, int sbk, const int HB, const int PRE, const int VBMI, SuperBlock *u) {
    const int G = HB == 2 ? 16 : 32, wpg = G / 8, K = t->K, gpb = 256 / G;
    const uint32_t *wp = t->w + ((size_t)p * (K / 8) + (size_t)sbk * 32) * PANEL;
    const uint32_t *hp = HB ? t->hw + ((size_t)p * (K * HB / 32) + (size_t)sbk * gpb) * PANEL : NULL;
    const int8_t *ksc = t->ksc + ((size_t)p * (K / G) + (size_t)sbk * gpb) * PANEL;
    const int8_t *km = t->km + ((size_t)p * (K / G) + (size_t)sbk * gpb) * PANEL;
    const __m512i low16 = _mm512_set1_epi32(0xffff);
#pragma GCC unroll 2
    for (int g = 0; g < gpb; g++) {
        const __m512i hw = HB ? _mm512_loadu_si512(hp + (size_t)g * PANEL) : _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int j = 0; PRE && j < wpg; j++) {
            const int word = g * wpg + j;
            PREFETCH(wp + (size_t)word * PANEL);
            avx512_nibbles(_mm512_loadu_si512(wp + (size_t)word * PANEL), hw, j, HB, VBMI, &u->w[2 * word], &u->w[2 * word + 1]);
        }
        u->sc[g] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(ksc + (size_t)g * PANEL))));
        if (g % 2) /* groups g - 1 and g's mins */
            u->m[g / 2] = _mm512_or_si512(
                _mm512_and_si512(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(km + (size_t)(g - 1) * PANEL))), low16),
                _mm512_slli_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(km + (size_t)g * PANEL))), 16));
    }
}

/* Super-block sbk's share of rows r..r+RB-1 (RB <= 4) of panel p for the K-quants with super-block
   activations (avx2_tile_sb and avx2_tile_sb6): Q4_K (HB 0) and Q5_K (HB 1) in groups of 32, Q6_K
   (HB 2) in groups of 16, into facc[r - r0]. A group's int32 dot times its int8 scale is summed over
   the super-block in float32 (a vpmulld took as long as two vpdpbusd): each product is exact there
   (|dot * sc| < 2^24) and so is their sum while it stays under 2^24, so the result is the AVX2 path's
   int32 sum converted once. The mins' term comes from the groups' integer activation sums, two
   groups a vpdpwssd. */
static inline AVX512_TARGET __attribute__((always_inline)) void
avx512_tile_sb(const Task *t, int p, int r, const int RB, const int HB, const int PRE, const int VBMI, int sbk,
               const SuperBlock *u, __m512 *facc, int r0) {
    const int G = HB == 2 ? 16 : 32, wpg = G / 8, K = t->K, ng = K / G, nsb = K / 256, gpb = 256 / G;
    const int8_t *x = sb_x(t, r, sbk * 256);
    const uint32_t *wp = t->w + ((size_t)p * (K / 8) + (size_t)sbk * 32) * PANEL;
    const uint32_t *hp = HB ? t->hw + ((size_t)p * (K * HB / 32) + (size_t)sbk * gpb) * PANEL : NULL;
    __m512 acc[4];
    __m512i mins[4];
    for (int i = 0; i < RB; i++) {
        acc[i] = _mm512_setzero_ps();
        mins[i] = _mm512_setzero_si512();
    }
    /* two groups at a time, each row one chain of vpdpbusd for each (five cycles' latency, two ports: a row
       needs two chains); a group's int32 dot is then converted and scaled as it is, where a chain for a group's
       low nibbles and one for its high ones had to be added first, a third float op per group and row beside
       eight vpdpbusd on the same two ports (same bits; Q6_K's groups of 16 get a second chain too): Q6_K
       matmuls 5-12% faster at 1-3 rows and 9-19% at 64-512, Q4_K's 4-9% at 3-16 rows */
#pragma GCC unroll 1
    for (int g = 0; g < gpb; g += 2) {
        __m512i dot[4][2];
        for (int i = 0; i < RB; i++) dot[i][0] = dot[i][1] = _mm512_setzero_si512();
        __m512i hw[2];
        for (int h = 0; h < 2; h++)
            hw[h] = HB && !PRE ? _mm512_loadu_si512(hp + (size_t)(g + h) * PANEL) : _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int j = 0; j < wpg; j++) {
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                const int word = (g + h) * wpg + j;
                __m512i lo, hi;
                if (PRE) {
                    lo = u->w[2 * word];
                    hi = u->w[2 * word + 1];
                } else {
                    const uint32_t *wj = wp + (size_t)word * PANEL;
                    if (!HW_STREAM(HB, RB)) PREFETCH(wj);
                    avx512_nibbles(_mm512_loadu_si512(wj), hw[h], j, HB, VBMI, &lo, &hi);
                }
#pragma GCC unroll 4
                for (int i = 0; i < RB; i++) {
                    const int8_t *xr = x + (size_t)i * 256 + (g + h) * G + 8 * j;
                    dot[i][h] = dpbusd_bcast(dot[i][h], lo, xr);
                    dot[i][h] = dpbusd_bcast(dot[i][h], hi, xr + 4);
                }
            }
        }
        for (int i = 0; i < RB; i++) {
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i][0]), u->sc[g], acc[i]);
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i][1]), u->sc[g + 1], acc[i]);
            mins[i] = dpwssd_bcast(mins[i], u->m[g / 2], t->xi16 + (size_t)(r + i) * ng + sbk * gpb + g);
        }
    }
    const size_t dofs = ((size_t)p * nsb + sbk) * PANEL;
    const __m512 dd = load_scales512(t->scales, dofs, t->f16), dm = load_scales512(t->biases, dofs, t->f16);
    for (int i = 0; i < RB; i++) {
        const __m512 xd = _mm512_set1_ps(t->xd[(size_t)(r + i) * nsb + sbk]);
        const __m512 f = _mm512_fmadd_ps(acc[i], _mm512_mul_ps(dd, xd), facc[r - r0 + i]);
        facc[r - r0 + i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(mins[i]), _mm512_mul_ps(dm, xd), f);
    }
}

/* Panel p's rows r0..r1 four at a time: TILE(t, p, r, rows, ...) for each block of rows. */
#define AVX512_ROWS(TILE, ...)                                             \
    do {                                                                   \
        int r = r0;                                                        \
        for (; r + 4 <= r1; r += 4) TILE(t, p, r, 4, __VA_ARGS__);         \
        switch (r1 - r) {                                                  \
        case 3: TILE(t, p, r, 3, __VA_ARGS__); break;                      \
        case 2: TILE(t, p, r, 2, __VA_ARGS__); break;                      \
        case 1: TILE(t, p, r, 1, __VA_ARGS__); break;                      \
        default: break;                                                    \
        }                                                                  \
    } while (0)

/* AVX512_ROWS with tiles of eight rows first. */
#define AVX512_ROWS8(TILE, ...)                                                  \
    do {                                                                         \
        for (; r0 + 8 <= r1; r0 += 8) TILE(t, p, r0, 8, __VA_ARGS__);            \
        AVX512_ROWS(TILE, __VA_ARGS__);                                          \
    } while (0)

/* Whether the K-quant kernels place high bits with VBMI's vpmultishiftqb (high_pairs512): set with the code path. */
static int g_vbmi = 0;

/* Each layout's own function, so that its loops get the registers to themselves. */
static AVX512_TARGET __attribute__((noinline)) void avx512_panel_q4(const Task *t, int p, int r0, int r1) {
    if (t->biases) AVX512_ROWS8(avx512_tile8, 4, 32, 0);
    else AVX512_ROWS8(avx512_tile8, 4, 32, 1);
}
static AVX512_TARGET __attribute__((noinline)) void avx512_panel_q8(const Task *t, int p, int r0, int r1) {
    if (t->biases) AVX512_ROWS8(avx512_tile8, 8, 32, 0);
    else AVX512_ROWS8(avx512_tile8, 8, 32, 1);
}
static AVX512_TARGET __attribute__((noinline)) void avx512_panel_affine4(const Task *t, int p, int r0, int r1) {
    AVX512_ROWS8(avx512_tile8, 4, 0, 0);
}
static AVX512_TARGET __attribute__((noinline)) void avx512_panel_affine8(const Task *t, int p, int r0, int r1) {
    AVX512_ROWS8(avx512_tile8, 8, 0, 0);
}
/* A K-quant panel's rows r0..r1 (at most ROW_TILE), one super-block at a time. */
static inline AVX512_TARGET __attribute__((always_inline)) void
avx512_panel_sb(const Task *t, int p, int r0, int r1, const int HB, const int PRE, const int VBMI) {
    SuperBlock u;
    __m512 facc[ROW_TILE];
    for (int r = r0; r < r1; r++) facc[r - r0] = _mm512_setzero_ps();
    for (int sbk = 0; sbk < t->K / 256; sbk++) {
        avx512_unpack_sb(t, p, sbk, HB, PRE, VBMI, &u);
        AVX512_ROWS(avx512_tile_sb, HB, PRE, VBMI, sbk, &u, facc, r0);
    }
    for (int r = r0; r < r1; r++) avx512_store(t, p, r, facc + (r - r0), 1);
}
static AVX512_TARGET __attribute__((noinline)) void avx512_panel_sb_q4k(const Task *t, int p, int r0, int r1) {
    if (r1 - r0 > 16) avx512_panel_sb(t, p, r0, r1, 0, 1, 0);
    else avx512_panel_sb(t, p, r0, r1, 0, 0, 0);
}
static AVX512_TARGET __attribute__((noinline)) void avx512_panel_sb_q5k(const Task *t, int p, int r0, int r1) {
    if (r1 - r0 > 4) avx512_panel_sb(t, p, r0, r1, 1, 1, g_vbmi);
    else if (g_vbmi) avx512_panel_sb(t, p, r0, r1, 1, 0, 1);
    else avx512_panel_sb(t, p, r0, r1, 1, 0, 0);
}
static AVX512_TARGET __attribute__((noinline)) void avx512_panel_sb_q6k(const Task *t, int p, int r0, int r1) {
    if (r1 - r0 > 4) avx512_panel_sb(t, p, r0, r1, 2, 1, g_vbmi);
    else if (g_vbmi) avx512_panel_sb(t, p, r0, r1, 2, 0, 1);
    else avx512_panel_sb(t, p, r0, r1, 2, 0, 0);
}

static AVX512_TARGET void kernel_avx512_8(const Task *t, int p0, int p1, int r0, int r1) {
    const int G = t->group;
    if (t->hbits && !t->sb) { /* K-quants in groups the super-block kernels do not take */
        kernel_avx2_8(t, p0, p1, r0, r1);
        return;
    }
    for (int p = p0; p < p1; p++) {
        if (t->sb && t->hbits == 2) avx512_panel_sb_q6k(t, p, r0, r1);
        else if (t->sb && t->hbits == 1) avx512_panel_sb_q5k(t, p, r0, r1);
        else if (t->sb) avx512_panel_sb_q4k(t, p, r0, r1);
        else if (t->bits == 4 && G == 32) avx512_panel_q4(t, p, r0, r1);
        else if (t->bits == 8 && G == 32) avx512_panel_q8(t, p, r0, r1);
        else if (t->bits == 4) avx512_panel_affine4(t, p, r0, r1);
        else avx512_panel_affine8(t, p, r0, r1);
    }
}
#endif /* QM_X86 */

/* ---- the code path and activation width in use; a gemm call's work on the pool ---- */

static kernel_fn g_kernel = kernel_generic;   /* int16 activations */
static kernel_fn g_kernel8 = kernel_generic8; /* int8 activations */
static int g_act_bits = 16;
static const char *g_isa = "generic";
static int g_isa_level = 0;
static Task g_task;

static void gemm_item(const void *ctx, int i) {
    const Task *t = (const Task *)ctx;
    int cols_chunks = (t->panels + t->chunk - 1) / t->chunk;
    int pc = i % cols_chunks, rt = i / cols_chunks;
    int p0 = pc * t->chunk, p1 = p0 + t->chunk < t->panels ? p0 + t->chunk : t->panels;
    int r0 = rt * ROW_TILE, r1 = r0 + ROW_TILE < t->R ? r0 + ROW_TILE : t->R;
    t->kernel(t, p0, p1, r0, r1);
}

int qm_isa_level(void) { return g_isa_level; }

/* Runs g_task (already filled) on the pool; called with qm_call_lock held and the GIL released. */
static void run_task(void) {
    Task *t = &g_task;
    t->row_tiles = (t->R + ROW_TILE - 1) / ROW_TILE;
    /* ~32 items per thread keep the load even when a worker starts late, and make the tail short: the thread
       that runs out first waits for the other's last item, which at 8 items a thread cost a 1B decode step
       ~8 us a call on the caller alone (2-3 us at 32; the weights still stream in order within a range) */
    int want = qm_threads() * 32 / t->row_tiles;
    if (want < 1) want = 1;
    t->chunk = (t->panels + want - 1) / want;
    t->items = ((t->panels + t->chunk - 1) / t->chunk) * t->row_tiles;
    qm_parallel(t->items, gemm_item, t);
}

/* ---- activation quantization: int16 per weight group, plus the group's float sum ---- */

/* The largest |v[k]| and the sum of v over a group of G values. */
static inline void group_amax_sum(const float *v, int G, float *amax, float *sum) {
    float m = 0.f, s = 0.f;
    for (int k = 0; k < G; k++) {
        float a = fabsf(v[k]);
        m = a > m ? a : m;
        s += v[k];
    }
    *amax = m;
    *sum = s;
}

static void quantize_rows(const float *x, int R, int K, int G, int16_t *xq, float *xd, float *xs) {
    int ng = K / G;
    for (int r = 0; r < R; r++) {
        for (int g = 0; g < ng; g++) {
            const float *v = x + (size_t)r * K + g * G;
            int16_t *q = xq + (size_t)r * K + g * G;
            float amax, sum;
            group_amax_sum(v, G, &amax, &sum);
            float inv = amax > 0.f ? 32767.f / amax : 0.f;
            for (int k = 0; k < G; k++) q[k] = (int16_t)lrintf(v[k] * inv);
            xd[(size_t)r * ng + g] = amax / 32767.f;
            xs[(size_t)r * ng + g] = sum;
        }
    }
}

/* int8 per weight group (scale max|x| / 127), stored in the weights' byte order: each 8 k of a
   4-bit word as x0 x4 x1 x5 | x2 x6 x3 x7 (its low nibbles' bytes hold w0 w4 w1 w5, its high
   nibbles' w2 w6 w3 w7), each 4 k of an 8-bit word as x0 x2 x1 x3; plus each group's float sum
   and the integer sum of every SG values (SG divides G: the weight group where the scale is a
   super-block's). Row r's group g goes to xq + r * rs + g * gs (row-major: K and G; see sb_x). */
static void quantize_rows8(const float *x, int R, int K, int G, int SG, int bits, int8_t *xq, size_t rs, size_t gs,
                           float *xd, float *xs, int32_t *xi) {
    static const int src4[8] = {0, 4, 1, 5, 2, 6, 3, 7}, src8[4] = {0, 2, 1, 3};
    const int ng = K / G, n = bits == 4 ? 8 : 4;
    const int *src = bits == 4 ? src4 : src8;
    for (int r = 0; r < R; r++) {
        for (int g = 0; g < ng; g++) {
            const float *v = x + (size_t)r * K + g * G;
            int8_t *q = xq + r * rs + g * gs;
            int32_t *si = xi + ((size_t)r * K + g * G) / SG;
            float amax, sum;
            group_amax_sum(v, G, &amax, &sum);
            const float inv = amax > 0.f ? 127.f / amax : 0.f;
            for (int k = 0; k < G; k += n)
                for (int e = 0; e < n; e++) {
                    int8_t qv = (int8_t)lrintf(v[k + src[e]] * inv);
                    q[k + e] = qv;
                    si[k / SG] = (k % SG || e ? si[k / SG] : 0) + qv;
                }
            xd[(size_t)r * ng + g] = amax / 127.f;
            xs[(size_t)r * ng + g] = sum;
        }
    }
}

#ifdef QM_X86
/* quantize_rows8 eight floats at a time (G a multiple of 8), the same integers: the float products
   rounded to nearest even as lrintf does; the byte order by one lane permute of the floats. */
static AVX2_TARGET void quantize_rows8_avx2(const float *x, int R, int K, int G, int SG, int bits, int8_t *xq,
                                            size_t rs, size_t gs, float *xd, float *xs, int32_t *xi) {
    const int ng = K / G;
    const __m256i order = bits == 4 ? _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7) : _mm256_setr_epi32(0, 2, 1, 3, 4, 6, 5, 7);
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int r = 0; r < R; r++) {
        for (int g = 0; g < ng; g++) {
            const float *v = x + (size_t)r * K + g * G;
            int8_t *q = xq + r * rs + g * gs;
            __m256 m = _mm256_setzero_ps(), s = _mm256_setzero_ps();
            for (int k = 0; k < G; k += 8) {
                const __m256 a = _mm256_loadu_ps(v + k);
                m = _mm256_max_ps(m, _mm256_and_ps(a, magnitude));
                s = _mm256_add_ps(s, a);
            }
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
            __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
            s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
            const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
            __m256i isum = _mm256_setzero_si256();
            for (int k = 0; k < G; k += 8) {
                const __m256i n = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_permutevar8x32_ps(_mm256_loadu_ps(v + k), order), inv));
                isum = _mm256_add_epi32(isum, n);
                const __m128i n16 = _mm_packs_epi32(_mm256_castsi256_si128(n), _mm256_extracti128_si256(n, 1));
                _mm_storel_epi64((__m128i *)(q + k), _mm_packs_epi16(n16, n16));
                if ((k + 8) % SG == 0) {
                    __m128i i4 = _mm_add_epi32(_mm256_castsi256_si128(isum), _mm256_extracti128_si256(isum, 1));
                    i4 = _mm_add_epi32(i4, _mm_shuffle_epi32(i4, 0x4e));
                    i4 = _mm_add_epi32(i4, _mm_shuffle_epi32(i4, 0xb1));
                    xi[((size_t)r * K + g * G + k) / SG] = _mm_cvtsi128_si32(i4);
                    isum = _mm256_setzero_si256();
                }
            }
            xd[(size_t)r * ng + g] = amax / 127.f;
            xs[(size_t)r * ng + g] = _mm_cvtss_f32(_mm_add_ss(s4, _mm_movehdup_ps(s4)));
        }
    }
}
#endif

/* One gemm call's activations to quantize, `chunk` rows an item. */
typedef struct {
    const float *x;
    int R, K, G, SG, bits, act8, chunk;
    size_t rs, gs; /* int8 activations: bytes between rows, between a row's groups */
    int16_t *xq;
    float *xd, *xs;
    int32_t *xi;
} QuantJob;

static void quantize_item(const void *ctx, int item) {
    const QuantJob *j = (const QuantJob *)ctx;
    const int r0 = item * j->chunk, rows = j->R - r0 < j->chunk ? j->R - r0 : j->chunk;
    const size_t at = (size_t)r0 * j->K, gat = (size_t)r0 * (j->K / j->G), sat = (size_t)r0 * (j->K / j->SG);
    int8_t *q8 = (int8_t *)j->xq + r0 * j->rs;
#ifdef QM_X86
    if (j->act8 && g_isa_level > 0 && j->SG % 8 == 0) {
        quantize_rows8_avx2(j->x + at, rows, j->K, j->G, j->SG, j->bits, q8, j->rs, j->gs, j->xd + gat, j->xs + gat,
                            j->xi + sat);
        return;
    }
#endif
    if (j->act8)
        quantize_rows8(j->x + at, rows, j->K, j->G, j->SG, j->bits, q8, j->rs, j->gs, j->xd + gat, j->xs + gat,
                       j->xi + sat);
    else
        quantize_rows(j->x + at, rows, j->K, j->G, j->xq + at, j->xd + gat, j->xs + gat);
}

static int16_t *g_xq;
static float *g_xd;
static size_t g_xq_cap, g_xd_cap;

static int reserve(size_t nq, size_t nd) {
    if (nq > g_xq_cap) {
        int16_t *p = (int16_t *)realloc(g_xq, nq * sizeof(int16_t));
        if (!p) return -1;
        g_xq = p;
        g_xq_cap = nq;
    }
    if (4 * nd > g_xd_cap) { /* scales, float sums, integer sums, and those as int16 */
        float *p = (float *)realloc(g_xd, 4 * nd * sizeof(float));
        if (!p) return -1;
        g_xd = p;
        g_xd_cap = 4 * nd;
    }
    return 0;
}

/* ---- Python entry points ---- */

static int get_buf(PyObject *o, Py_buffer *b, int writable) {
    return PyObject_GetBuffer(o, b, (writable ? PyBUF_WRITABLE : 0) | PyBUF_STRIDES | PyBUF_FORMAT);
}

/* Fills m from gemm's weight arguments (w, scales, biases, N, bits, group, f16[, hi, hbits, sc, m]:
   7 or 11 objects; biases a number c for symmetric groups, whose bias is -c * scale) for inputs of K
   columns, holding their buffers in held[*nheld...] (at most 6); -1 with an error set when they do
   not fit together. */
int qm_matrix_parse(PyObject *const *a, int n, Py_ssize_t K, QmMatrix *m, Py_buffer *held, int *nheld) {
    if (n != 7 && n != 11) {
        PyErr_SetString(PyExc_TypeError, "a packed matrix takes 7 or 11 arguments");
        return -1;
    }
    const int kq = n == 11, symmetric = !kq && (PyFloat_Check(a[2]) || PyLong_Check(a[2]));
    long N = PyLong_AsLong(a[3]), bits = PyLong_AsLong(a[4]), group = PyLong_AsLong(a[5]);
    long hbits = kq ? PyLong_AsLong(a[8]) : 0;
    double center = symmetric ? PyFloat_AsDouble(a[2]) : 0.0;
    int f16 = PyObject_IsTrue(a[6]);
    if (PyErr_Occurred()) return -1;
    /* w, scales, biases (none for symmetric groups), then for K-quants sc, m and hi */
    PyObject *src[6] = {a[0], a[1], symmetric ? NULL : a[2], kq ? a[9] : NULL, kq ? a[10] : NULL, kq && hbits ? a[7] : NULL};
    Py_buffer *b[6] = {NULL};
    size_t len[6] = {0};
    for (int i = 0; i < 6; i++) {
        if (!src[i]) continue;
        b[i] = held + *nheld;
        if (get_buf(src[i], b[i], 0) < 0) return -1;
        (*nheld)++;
        len[i] = (size_t)b[i]->len;
    }
    int center_exp; /* a symmetric center must be a power of two (see the notes on top) */
    if (N < 0 || (bits != 4 && bits != 8) || group <= 0 || K % group ||
        (symmetric && frexp(center, &center_exp) != 0.5) ||
        (kq ? bits != 4 || hbits < 0 || hbits > 2 || (group != 16 && group != 32) || K % 256 : group % 32)) {
        PyErr_SetString(PyExc_ValueError, "gemm: bad shapes, strides or parameters");
        return -1;
    }
    /* a group's integer dot with int16 activations, (2^bits - 1) * 32767 * group, must fit int32 */
    const long max_q = (1L << (kq ? 4 + hbits : bits)) - 1;
    if ((int64_t)max_q * 32767 * group > INT32_MAX) {
        PyErr_Format(PyExc_ValueError,
                     "gemm: groups of %ld weights below %ld overflow the kernels' int32 sums (at most %ld a group)",
                     group, max_q + 1, (long)(INT32_MAX / ((int64_t)max_q * 32767)));
        return -1;
    }
    int panels = (int)((N + PANEL - 1) / PANEL);
    size_t need_w = (size_t)panels * K * bits / 8;
    size_t need_s = (size_t)panels * (K / (kq ? 256 : group)) * PANEL * (f16 ? 2 : 4);
    size_t need_k = (size_t)panels * (K / group) * PANEL, need_h = (size_t)panels * K * hbits / 8;
    if (len[0] < need_w || len[1] < need_s || (!symmetric && len[2] < need_s) ||
        (kq && (len[3] < need_k || len[4] < need_k || (hbits && len[5] < need_h)))) {
        PyErr_SetString(PyExc_ValueError, "gemm: packed weight buffers too small for the shape");
        return -1;
    }
    *m = (QmMatrix){
        .w = (const uint32_t *)b[0]->buf, .scales = b[1]->buf, .biases = symmetric ? NULL : b[2]->buf,
        .ksc = kq ? (const int8_t *)b[3]->buf : NULL, .km = kq ? (const int8_t *)b[4]->buf : NULL,
        .hw = hbits ? (const uint32_t *)b[5]->buf : NULL, .center = (float)center,
        .N = (int)N, .K = (int)K, .bits = (int)bits, .group = (int)group, .f16 = f16, .kq = kq, .hbits = (int)hbits,
    };
    return 0;
}

int qm_gemm(const QmMatrix *m, const float *x, int R, float *out, Py_ssize_t ldo) {
    const int K = m->K, G = m->group;
    if (reserve((size_t)R * K, (size_t)R * (K / G)) < 0) return -1;
    if (R <= 0 || m->N <= 0) return 0;
    const size_t nd = (size_t)R * (K / G);
    float *xd = g_xd, *xs = g_xd + nd;
    int32_t *xi = (int32_t *)(g_xd + 2 * nd);
    int16_t *xi16 = (int16_t *)(g_xd + 3 * nd);
    const int act8 = g_act_bits == 8;
    /* K-quants on the AVX2 path scale activations per super-block (avx2_tile_sb), one row or many */
    const int sb = act8 && g_isa_level > 0 && m->kq && G == (m->hbits == 2 ? 16 : 32);
    /* on one thread, quantizing 512 rows left the other idle for a seventh of the matmul's time */
    QuantJob job = {x, R, K, sb ? 256 : G, G, m->bits, act8, R >= 64 ? 8 : R, sb ? 256 : K, sb ? (size_t)R * 256 : G,
                    g_xq, xd, xs, xi};
    if (R >= 64) qm_parallel((R + job.chunk - 1) / job.chunk, quantize_item, &job);
    else quantize_item(&job, 0);
    if (sb) /* a group's sum is at most 32 * 127 */
        for (size_t i = 0; i < nd; i++) xi16[i] = (int16_t)xi[i];
    if (!m->kq && !m->biases)
        for (size_t i = 0; i < nd; i++) xs[i] *= -m->center;
    Task *t = &g_task;
    *t = (Task){
        .w = m->w, .scales = m->scales, .biases = m->biases, .xq = act8 ? NULL : g_xq,
        .x8 = act8 ? (const int8_t *)g_xq : NULL, .xi = xi, .xi16 = xi16, .xd = xd, .xs = xs, .out = out, .ldo = ldo,
        .kernel = act8 ? g_kernel8 : g_kernel,
        .R = R, .K = K, .N = m->N, .bits = m->bits, .group = G, .f16 = m->f16, .hw = m->hw, .ksc = m->ksc,
        .km = m->km, .hbits = m->hbits, .kq = m->kq, .sb = sb, .panels = (m->N + PANEL - 1) / PANEL,
    };
    run_task();
    return 0;
}

/* gemm(x, w, scales, biases, out, N, bits, group, f16[, hi, hbits, sc, m]): out[:, :N] = x @ W.T.
   x float32 [R, K] C-contiguous; out float32 [R, >=N] with unit column stride; biases a number c
   for symmetric groups (bias -c * scale). With the four extra arguments the segment is a K-quant
   one: scales and biases are d and dmin, sc and m the int8 group scales and mins, hi the high-bit
   plane (None where hbits is 0). */
static PyObject *py_gemm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 9 && nargs != 13) {
        PyErr_SetString(PyExc_TypeError, "gemm takes 9 or 13 arguments");
        return NULL;
    }
    Py_buffer b[8];
    int held = 0, err = 0;
    QmMatrix m;
    PyObject *wargs[11] = {args[1], args[2], args[3]};
    for (int i = 5; i < nargs; i++) wargs[i - 2] = args[i];
    if (get_buf(args[0], &b[held], 0) < 0) goto fail;
    held++;
    if (get_buf(args[4], &b[held], 1) < 0) goto fail;
    held++;
    Py_buffer *bx = &b[0], *bo = &b[1];
    if (bx->ndim != 2 || strcmp(bx->format, "f") || bx->strides[1] != 4 || bx->strides[0] != bx->shape[1] * 4) {
        PyErr_SetString(PyExc_ValueError, "gemm: bad shapes, strides or parameters");
        goto fail;
    }
    if (qm_matrix_parse(wargs, (int)nargs - 2, bx->shape[1], &m, b, &held) < 0) goto fail;
    if (strcmp(bo->format, "f") || bo->ndim != 2 || bo->itemsize != 4 || bo->strides[1] != 4 ||
        bo->shape[0] != bx->shape[0] || bo->shape[1] < m.N) {
        PyErr_SetString(PyExc_ValueError, "gemm: bad shapes, strides or parameters");
        goto fail;
    }
    WITH_POOL(err = qm_gemm(&m, (const float *)bx->buf, (int)bx->shape[0], (float *)bo->buf, bo->strides[0] / 4));
    if (err) {
        PyErr_NoMemory();
        goto fail;
    }
    while (held > 0) PyBuffer_Release(&b[--held]);
    Py_RETURN_NONE;
fail:
    while (held > 0) PyBuffer_Release(&b[--held]);
    return NULL;
}

/* Row n of W into out [K]: qmatmul._rows' float32 operations in its order, so the same bits (an embedding
   lookup: a dozen NumPy calls a token, 0.2-0.35 ms for a 2048-wide Q6_K table, where this takes microseconds).
   center: Q6_K's offset, whose values are (d * sc) * (q - center); 0 for the other K-quants. */
static void matrix_row(const QmMatrix *m, int n, float center, float *out) {
    const int K = m->K, p = n / PANEL, lane = n % PANEL, epw = 32 / m->bits, G = m->group;
    const uint32_t mask = (1u << m->bits) - 1;
    const uint32_t *w = m->w + (size_t)p * (K / epw) * PANEL + lane;
    for (int k = 0; k < K; k++) {
        const int e = k % epw; /* pairs of adjacent k sit in a word's two int16 halves (qmatmul._SHIFTS) */
        uint32_t q = (w[(size_t)(k / epw) * PANEL] >> ((e / 2) * m->bits + (e % 2) * 16)) & mask;
        const size_t g = ((size_t)p * (K / G) + k / G) * PANEL + lane;
        if (m->kq) {
            if (m->hbits) {
                const int per = 32 / m->hbits, h = k % per;
                const uint32_t hw = m->hw[((size_t)p * (K * m->hbits / 32) + k / per) * PANEL + lane];
                q |= ((hw >> (m->hbits * (h / 2) + 16 * (h % 2))) & ((1u << m->hbits) - 1)) << 4;
            }
            const size_t sb = ((size_t)p * (K / 256) + k / 256) * PANEL + lane;
            /* products and sums as separate statements: a compiler may fuse them within one (clang's default) */
            const float scale = load_scale(m->scales, sb, m->f16) * (float)m->ksc[g];
            if (center != 0.f) {
                out[k] = scale * ((float)q - center);
                continue;
            }
            const float bias = load_scale(m->biases, sb, m->f16) * (float)m->km[g], value = scale * (float)q;
            out[k] = value + bias;
        } else {
            const float scale = load_scale(m->scales, g, m->f16);
            const float bias = m->biases ? load_scale(m->biases, g, m->f16) : -m->center * scale, value = (float)q * scale;
            out[k] = value + bias;
        }
    }
}

/* rows(ids, out, center, w, scales, biases, N, bits, group, f16[, hi, hbits, sc, m]): out[i] = row ids[i] of W
   (int64 ids below N, out float32 [len(ids), K] C-contiguous). */
static PyObject *py_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 10 && nargs != 14) {
        PyErr_SetString(PyExc_TypeError, "rows takes 10 or 14 arguments");
        return NULL;
    }
    Py_buffer b[8];
    int held = 0;
    QmMatrix m;
    const double center = PyFloat_AsDouble(args[2]);
    if (center == -1.0 && PyErr_Occurred()) return NULL;
    if (get_buf(args[0], &b[held], 0) < 0) goto fail;
    held++;
    if (get_buf(args[1], &b[held], 1) < 0) goto fail;
    held++;
    Py_buffer *bi = &b[0], *bo = &b[1];
    if (!qm_is_i64(bi) || bi->ndim != 1 || bi->strides[0] != 8 || !qm_is_f32(bo) || bo->ndim != 2 ||
        bo->shape[0] != bi->shape[0] || bo->strides[1] != 4 || bo->strides[0] != bo->shape[1] * 4) {
        PyErr_SetString(PyExc_ValueError, "rows: bad shapes, strides or types");
        goto fail;
    }
    if (qm_matrix_parse(args + 3, (int)nargs - 3, bo->shape[1], &m, b, &held) < 0) goto fail;
    const int64_t *ids = (const int64_t *)bi->buf;
    for (Py_ssize_t i = 0; i < bi->shape[0]; i++)
        if (ids[i] < 0 || ids[i] >= m.N) {
            PyErr_Format(PyExc_ValueError, "rows: row %lld falls outside the %d rows", (long long)ids[i], m.N);
            goto fail;
        }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < bi->shape[0]; i++) matrix_row(&m, (int)ids[i], (float)center, (float *)bo->buf + i * m.K);
    Py_END_ALLOW_THREADS
    while (held > 0) PyBuffer_Release(&b[--held]);
    Py_RETURN_NONE;
fail:
    while (held > 0) PyBuffer_Release(&b[--held]);
    return NULL;
}

/* A word of MLX's packing (value k0 + i at bits * i) in the kernels' order (see the top of this file): for 4
   bits nibbles 1 and 2, 5 and 6 swap, then bytes 1 and 2, giving nibbles k0 + 0, 2, 4, 6, 1, 3, 5, 7; 8 bits
   swap bytes 1 and 2 alone, giving bytes k0 + 0, 2, 1, 3. */
static inline uint32_t kernel_word(uint32_t x, int bits) {
    if (bits == 4) x = (x & 0xF00FF00Fu) | ((x & 0x00F000F0u) << 4) | ((x >> 4) & 0x00F000F0u);
    return (x & 0xFF0000FFu) | ((x & 0x0000FF00u) << 8) | ((x >> 8) & 0x0000FF00u);
}

/* Whether b is C-contiguous uint32 panels [panels, W, 16] holding rows row0..row0+n-1. */
static int panels_fit(const Py_buffer *b, Py_ssize_t W, Py_ssize_t row0, Py_ssize_t n) {
    return qm_is_u32(b) && b->ndim == 3 && PyBuffer_IsContiguous(b, 'C') && b->shape[1] == W && b->shape[2] == PANEL &&
           row0 >= 0 && row0 + n <= b->shape[0] * PANEL;
}

/* panel_words(words, out, bits, row0): a matrix part's MLX-packed words [n, W] into the panels out
   [panels, W, 16] at rows row0..row0+n-1, in the kernels' order (prepare's repacking, in one pass). */
static PyObject *py_panel_words(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "panel_words takes 4 arguments");
        return NULL;
    }
    const long bits = PyLong_AsLong(args[2]), row0 = PyLong_AsLong(args[3]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer b[2];
    int held = 0;
    if (get_buf(args[0], &b[held], 0) < 0) goto fail;
    held++;
    if (get_buf(args[1], &b[held], 1) < 0) goto fail;
    held++;
    Py_buffer *bw = &b[0], *bo = &b[1];
    const Py_ssize_t n = bw->ndim == 2 ? bw->shape[0] : 0, W = bw->ndim == 2 ? bw->shape[1] : 0;
    if ((bits != 4 && bits != 8) || !qm_is_u32(bw) || bw->ndim != 2 || !PyBuffer_IsContiguous(bw, 'C') ||
        !panels_fit(bo, W, row0, n)) {
        PyErr_SetString(PyExc_ValueError, "panel_words: bad bits, shapes, strides or types");
        goto fail;
    }
    const uint32_t *w = (const uint32_t *)bw->buf;
    uint32_t *out = (uint32_t *)bo->buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        const Py_ssize_t row = row0 + i;
        uint32_t *col = out + (row / PANEL) * W * PANEL + row % PANEL;
        const uint32_t *src = w + i * W;
        for (Py_ssize_t j = 0; j < W; j++) col[j * PANEL] = kernel_word(src[j], (int)bits);
    }
    Py_END_ALLOW_THREADS
    while (held > 0) PyBuffer_Release(&b[--held]);
    Py_RETURN_NONE;
fail:
    while (held > 0) PyBuffer_Release(&b[--held]);
    return NULL;
}

/* GGML type ids (ggml.h) of the blocks block_words reads. */
enum { GGML_Q4_0 = 2, GGML_Q8_0 = 8, GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14 };

/* The MLX word of 8 nibbles (value i at bits 4i) from the nibble at `shift` (0 or 4) of 8 bytes. */
static inline uint32_t nibbles8(const uint8_t *p, int shift) {
    uint64_t x;
    memcpy(&x, p, 8);
    x = (x >> shift) & 0x0F0F0F0F0F0F0F0Full;
    x = (x | (x >> 4)) & 0x00FF00FF00FF00FFull;
    x = (x | (x >> 8)) & 0x0000FFFF0000FFFFull;
    return (uint32_t)(x | (x >> 16));
}

/* A super-block's (or Q4_0 block's) 4-bit words in the kernels' order: `n` words of 8 consecutive values, word j
   taken from bytes src + at[j] at nibble shift sh[j]. */
static inline void block_nibble_words(const uint8_t *src, const int *at, const int *sh, int n, uint32_t *col) {
    for (int j = 0; j < n; j++) col[j * PANEL] = kernel_word(nibbles8(src + at[j], sh[j]), 4);
}

/* High-bit words of a super-block (Q5_K: 8 words of 32 values, Q6_K: 16 of 16): value e of a word at bit
   hbits * (e / 2) of its low (even e) or high (odd e) int16 half, as qmatmul._high_bit_words lays them. */
static inline void block_high_words(const uint8_t *b, int qtype, uint32_t *col) {
    if (qtype == GGML_Q5_K) {
        const uint8_t *qh = b + 16;  /* value 32 g + i has bit g of qh[i] */
        for (int g = 0; g < 8; g++) {
            uint32_t w = 0;
            for (int i = 0; i < 32; i++) w |= (uint32_t)((qh[i] >> g) & 1) << (i / 2 + 16 * (i % 2));
            col[g * PANEL] = w;
        }
        return;
    }
    const uint8_t *qh = b + 128;  /* value v: bits 2t of qh[32 h + i], v = 128 h + 32 t + i */
    for (int g = 0; g < 16; g++) {
        uint32_t w = 0;
        for (int e = 0; e < 16; e++) {
            const int v = 16 * g + e, h = v / 128, t = (v % 128) / 32, i = v % 32;
            w |= (uint32_t)((qh[32 * h + i] >> (2 * t)) & 3) << (2 * (e / 2) + 16 * (e % 2));
        }
        col[g * PANEL] = w;
    }
}

/* A block_words call: rows of GGUF blocks and the panels they go into. */
typedef struct {
    const uint8_t *src;
    uint32_t *out, *hout;
    Py_ssize_t n, row0, row_bytes, blocks, W, HW;
    int qtype, block_bytes, hbits;
    int k_at[32], k_sh[32]; /* K-quants: where each 8-value word of a super-block starts (byte, nibble shift) */
} BlockWords;

/* Rows r0..r1-1 of the call's part into their panels. */
static void block_words_rows(const BlockWords *t, Py_ssize_t r0, Py_ssize_t r1) {
    static const int q4_0_at[4] = {2, 10, 2, 10}, q4_0_sh[4] = {0, 0, 4, 4}; /* Q4_0: low nibbles, then high */
    for (Py_ssize_t r = r0; r < r1; r++) {
        const Py_ssize_t row = t->row0 + r, lane = row % PANEL;
        uint32_t *col = t->out + (row / PANEL) * t->W * PANEL + lane;
        uint32_t *hcol = t->hout ? t->hout + (row / PANEL) * t->HW * PANEL + lane : NULL;
        for (Py_ssize_t k = 0; k < t->blocks; k++) {
            const uint8_t *blk = t->src + r * t->row_bytes + k * t->block_bytes;
            if (t->qtype == GGML_Q4_0) {
                block_nibble_words(blk, q4_0_at, q4_0_sh, 4, col + k * 4 * PANEL);
            } else if (t->qtype == GGML_Q8_0) {
                for (int j = 0; j < 8; j++) {
                    uint32_t x;
                    memcpy(&x, blk + 2 + 4 * j, 4);
                    col[(k * 8 + j) * PANEL] = kernel_word(x ^ 0x80808080u, 8);
                }
            } else {
                block_nibble_words(blk, t->k_at, t->k_sh, 32, col + k * 32 * PANEL);
                if (hcol) block_high_words(blk, t->qtype, hcol + k * 8 * t->hbits * PANEL);
            }
        }
    }
}

/* Item i: the part's rows in the i-th panel it touches (so no two threads write one panel's cache lines). */
static void block_words_item(const void *ctx, int i) {
    const BlockWords *t = (const BlockWords *)ctx;
    const Py_ssize_t first = t->row0 / PANEL * PANEL, r0 = first + (Py_ssize_t)i * PANEL - t->row0;
    block_words_rows(t, r0 > 0 ? r0 : 0, r0 + PANEL < t->n ? r0 + PANEL : t->n);
}

/* block_words(blocks, qtype, out, hi, row0): a GGUF matrix part's rows of Q4_0, Q8_0, Q4_K, Q5_K or Q6_K blocks
   [n, bytes a row] into the kernels' panels at rows row0..row0+n-1: the (low) 4-bit or 8-bit values into out
   [panels, K * bits / 32, 16] and the K-quants' 5th/6th bits into hi [panels, K * hbits / 32, 16] (None for the
   others). Q8_0's signed values are stored + 128. Scales are left to the caller (they are a small part). */
static PyObject *py_block_words(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "block_words takes 5 arguments");
        return NULL;
    }
    const long qtype = PyLong_AsLong(args[1]), row0 = PyLong_AsLong(args[4]);
    if (PyErr_Occurred()) return NULL;
    int block_bytes, values, bits = 4, hbits = 0;
    switch (qtype) {
    case GGML_Q4_0: block_bytes = 18, values = 32; break;
    case GGML_Q8_0: block_bytes = 34, values = 32, bits = 8; break;
    case GGML_Q4_K: block_bytes = 144, values = 256; break;
    case GGML_Q5_K: block_bytes = 176, values = 256, hbits = 1; break;
    case GGML_Q6_K: block_bytes = 210, values = 256, hbits = 2; break;
    default: PyErr_Format(PyExc_ValueError, "block_words: unsupported GGML type %ld", qtype); return NULL;
    }
    Py_buffer b[3];
    int held = 0;
    if (get_buf(args[0], &b[held], 0) < 0) goto fail;
    held++;
    if (get_buf(args[2], &b[held], 1) < 0) goto fail;
    held++;
    if (hbits && get_buf(args[3], &b[held], 1) < 0) goto fail;
    held += hbits > 0;
    Py_buffer *bb = &b[0], *bo = &b[1], *bh = hbits ? &b[2] : NULL;
    const Py_ssize_t n = bb->ndim == 2 ? bb->shape[0] : 0, row_bytes = bb->ndim == 2 ? bb->shape[1] : 0;
    const Py_ssize_t blocks = row_bytes / block_bytes, K = blocks * values, W = K * bits / 32, HW = K * hbits / 32;
    if (bb->ndim != 2 || bb->itemsize != 1 || !PyBuffer_IsContiguous(bb, 'C') || row_bytes % block_bytes ||
        !panels_fit(bo, W, row0, n) || (bh && (!panels_fit(bh, HW, row0, n) || bh->shape[0] != bo->shape[0]))) {
        PyErr_SetString(PyExc_ValueError, "block_words: bad type, shapes, strides or dtypes");
        goto fail;
    }
    BlockWords t = {.src = (const uint8_t *)bb->buf, .out = (uint32_t *)bo->buf,
                    .hout = bh ? (uint32_t *)bh->buf : NULL, .n = n, .row0 = row0, .row_bytes = row_bytes,
                    .blocks = blocks, .W = W, .HW = HW, .qtype = (int)qtype, .block_bytes = block_bytes, .hbits = hbits};
    for (int j = 0; j < 32; j++) { /* GGML's nibble orders (quant/kquants.py) */
        const int v = 8 * j;
        if (qtype == GGML_Q6_K) /* value 128 h + 64 s + i: nibble s of ql[64 h + i] */
            t.k_at[j] = 64 * (v / 128) + v % 64, t.k_sh[j] = 4 * ((v % 128) / 64);
        else /* Q4_K, Q5_K: value 64 c + 32 s + i: nibble s of qs[32 c + i] */
            t.k_at[j] = (qtype == GGML_Q4_K ? 16 : 48) + 32 * (v / 64) + v % 32, t.k_sh[j] = 4 * ((v % 64) / 32);
    }
    const int panels = n ? (int)((row0 + n - 1) / PANEL - row0 / PANEL + 1) : 0;
    WITH_POOL(qm_parallel(panels, block_words_item, &t));
    while (held > 0) PyBuffer_Release(&b[--held]);
    Py_RETURN_NONE;
fail:
    while (held > 0) PyBuffer_Release(&b[--held]);
    return NULL;
}

static PyObject *py_set_num_threads(PyObject *self, PyObject *arg) {
    (void)self;
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 1) n = 1;
    WITH_POOL(qm_pool_set_threads((int)n));
    return PyLong_FromLong(qm_threads());
}

static PyObject *py_get_num_threads(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyLong_FromLong(qm_threads());
}

static PyObject *py_set_activation_bits(PyObject *self, PyObject *arg) {
    (void)self;
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n != 8 && n != 16) {
        PyErr_Format(PyExc_ValueError, "activation integers are 8 or 16 bits, not %ld", n);
        return NULL;
    }
    WITH_POOL(g_act_bits = (int)n);
    Py_RETURN_NONE;
}

static PyObject *py_set_spin_us(PyObject *self, PyObject *arg) {
    (void)self;
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    qm_pool_set_spin_us(n < 0 ? 0 : (int)n);
    Py_RETURN_NONE;
}

static int isa_supported(const char *name) {
    if (!strcmp(name, "generic")) return 1;
#ifdef QM_X86
    __builtin_cpu_init();
    /* both paths convert float16 scales with F16C and use FMA */
    const int base = __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (!strcmp(name, "avx2")) return base && __builtin_cpu_supports("avx2");
    if (!strcmp(name, "avx512vnni") || !strcmp(name, "avx512vnni-novbmi"))
        return base && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("avx512f") &&
               __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
               __builtin_cpu_supports("avx512vnni");
#endif
    return 0;
}

static void select_isa(const char *name) {
#ifdef QM_X86
    if (strcmp(name, "generic")) g_kernel8 = kernel_avx2_8;
    if (!strncmp(name, "avx512vnni", 10)) { /* "-novbmi": without VBMI where the CPU has it (for tests) */
        g_kernel = kernel_avx512;
        g_kernel8 = kernel_avx512_8;
        g_vbmi = !strcmp(name, "avx512vnni") && __builtin_cpu_supports("avx512vbmi");
        g_isa = !strcmp(name, "avx512vnni") ? "avx512vnni" : "avx512vnni-novbmi";
        g_isa_level = 2;
        return;
    }
    if (!strcmp(name, "avx2")) {
        g_kernel = kernel_avx2;
        g_isa = "avx2";
        g_isa_level = 1;
        return;
    }
#endif
    g_kernel = kernel_generic;
    g_kernel8 = kernel_generic8;
    g_isa = "generic";
    g_isa_level = 0;
}

/* set_isa(name or None): use that code path (for tests); None picks the best the CPU runs. */
static PyObject *py_set_isa(PyObject *self, PyObject *arg) {
    (void)self;
    const char *name;
    if (arg == Py_None) {
        name = isa_supported("avx512vnni") ? "avx512vnni" : isa_supported("avx2") ? "avx2" : "generic";
    } else {
        name = PyUnicode_AsUTF8(arg);
        if (!name) return NULL;
        if (!isa_supported(name)) {
            PyErr_Format(PyExc_ValueError, "instruction set %s is not available on this CPU", name);
            return NULL;
        }
    }
    WITH_POOL(select_isa(name));
    return PyUnicode_FromString(g_isa);
}

static PyObject *py_isa(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyUnicode_FromString(g_isa);
}

static PyMethodDef methods[] = {
    {"gemm", (PyCFunction)(void (*)(void))py_gemm, METH_FASTCALL, "gemm(x, w, scales, biases, out, N, bits, group, f16[, hi, hbits, sc, m])"},
    {"rows", (PyCFunction)(void (*)(void))py_rows, METH_FASTCALL,
     "rows(ids, out, center, w, scales, biases, N, bits, group, f16[, hi, hbits, sc, m]): rows of W, dequantized"},
    {"block_words", (PyCFunction)(void (*)(void))py_block_words, METH_FASTCALL,
     "block_words(blocks, qtype, out, hi, row0): GGUF Q4_0/Q8_0/Q4_K/Q5_K/Q6_K rows into the panels out (and hi) at row0"},
    {"panel_words", (PyCFunction)(void (*)(void))py_panel_words, METH_FASTCALL,
     "panel_words(words, out, bits, row0): MLX-packed 4- or 8-bit words [n, W] into panels out [panels, W, 16] at row0"},
    {"set_num_threads", py_set_num_threads, METH_O, "Threads per call, the caller's included; returns the count in use."},
    {"get_num_threads", py_get_num_threads, METH_NOARGS, "Threads per call."},
    {"set_activation_bits", py_set_activation_bits, METH_O, "Quantize activations to 8- or 16-bit integers per group."},
    {"set_spin_us", py_set_spin_us, METH_O, "How long idle workers spin before sleeping, in microseconds."},
    {"attention", (PyCFunction)(void (*)(void))qm_py_attention, METH_FASTCALL,
     "attention(q, k_cache, v_cache, block_tables, context_lens, out, scale[, window]) -> whether it ran"},
    {"rms_norm", (PyCFunction)(void (*)(void))qm_py_rms_norm, METH_FASTCALL, "rms_norm(x, w, out, eps) -> whether it ran"},
    {"rope", (PyCFunction)(void (*)(void))qm_py_rope, METH_FASTCALL, "rope(x, cos, sin, out) -> whether it ran"},
    {"silu_mul", (PyCFunction)(void (*)(void))qm_py_silu_mul, METH_FASTCALL, "silu_mul(gate_up, out, gelu=False) -> whether it ran (gelu: the GELU-tanh gate instead of SiLU)"},
    {"write_kv", (PyCFunction)(void (*)(void))qm_py_write_kv, METH_FASTCALL, "write_kv(cache, values, slots) -> whether it ran"},
    {"logit_stats", (PyCFunction)(void (*)(void))qm_py_logit_stats, METH_FASTCALL,
     "logit_stats(x, rows, norm, top) -> whether it ran: rows' log-sum-exp and top ids"},
    {"sample_logits", (PyCFunction)(void (*)(void))qm_py_sample_logits, METH_FASTCALL,
     "sample_logits(x, rows, inv_t, top_k, top_p, min_p, u, token) -> whether it ran: a token drawn from each row"},
    {"decoder_plan", (PyCFunction)(void (*)(void))qm_py_decoder_plan, METH_FASTCALL,
     "decoder_plan(hidden, n_heads, n_kv_heads, head_dim, intermediate, eps, layers, ropes) -> plan"},
    {"decoder_run", (PyCFunction)(void (*)(void))qm_py_decoder_run, METH_FASTCALL,
     "decoder_run(plan, h, k_pools, v_pools, positions, slots, block_tables, context_lens): every layer, h in place"},
    {"set_isa", py_set_isa, METH_O, "Pick a code path by name, or None for the best one; returns its name."},
    {"isa", py_isa, METH_NOARGS, "The code path in use."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_qmatmul", "Quantized matmul kernels and fused CPU ops.", -1, methods};

PyMODINIT_FUNC PyInit__qmatmul(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    select_isa(isa_supported("avx512vnni") ? "avx512vnni" : isa_supported("avx2") ? "avx2" : "generic");
    PyObject *kv_types = qm_kv_type_names();
    if (!kv_types || PyModule_AddObject(m, "KV_TYPES", kv_types) < 0) {
        Py_XDECREF(kv_types);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
