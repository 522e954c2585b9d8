/* The thread pool behind the _qmatmul extension's C ops: workers spin briefly for the next call
(decode calls come microseconds apart), then sleep.

A call's items are cut into one contiguous range per thread. Each thread works through its own
range from the front, so its items (a gemm's neighbouring panels) stream through memory in order,
then takes items from the back of the others' ranges: a descheduled thread delays only the items
it is running. A claim is a CAS on the range's word that also checks the call's generation, so a
worker waking late for a finished call claims nothing and never reads the task fields while the
next call writes them. */
#include "_pool.h"

#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#define MAX_THREADS 64
#define WORKER_STACK ((size_t)4 << 20)

static int g_threads = 1;                 /* threads used per call, the caller included */
static int g_started = 0;                 /* workers created so far */
static pthread_t g_workers[MAX_THREADS];
pthread_mutex_t qm_call_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t g_sleep_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_wake = PTHREAD_COND_INITIALIZER;
static atomic_uint g_gen;                 /* bumped once per call */
static atomic_int g_sleepers;
/* One range of items per thread of a call: (generation << 42) | (first left << 21) | end. */
static _Atomic uint64_t g_ranges[MAX_THREADS];
static atomic_int g_nranges;              /* ranges of the current call (read by late workers too) */
static atomic_int g_done;                 /* items finished in the current call */
static qm_item_fn g_fn;                   /* the current call's work */
static const void *g_ctx;
static int g_spin_us = 100;
static _Thread_local int tl_index; /* 0 on every thread but the workers, which set their own */

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}

#define RANGE_BITS 21
#define RANGE_MASK ((1u << RANGE_BITS) - 1)
#define GEN_MASK ((1u << (64 - 2 * RANGE_BITS)) - 1)

static inline uint64_t range_word(unsigned gen, unsigned lo, unsigned hi) {
    return ((uint64_t)(gen & GEN_MASK) << (2 * RANGE_BITS)) | ((uint64_t)lo << RANGE_BITS) | hi;
}

/* An item of range r (its first left, or its last), or -1 when none is left in this call. */
static int claim(int r, unsigned gen, int front) {
    uint64_t c = atomic_load(&g_ranges[r]);
    for (;;) {
        unsigned lo = (unsigned)(c >> RANGE_BITS) & RANGE_MASK, hi = (unsigned)c & RANGE_MASK;
        if ((unsigned)(c >> (2 * RANGE_BITS)) != (gen & GEN_MASK) || lo >= hi) return -1;
        if (atomic_compare_exchange_weak(&g_ranges[r], &c, front ? range_word(gen, lo + 1, hi)
                                                                 : range_word(gen, lo, hi - 1)))
            return (int)(front ? lo : hi - 1);
    }
}

static void run_items(unsigned gen, int self) {
    const int n = atomic_load_explicit(&g_nranges, memory_order_relaxed);
    int i;
    for (int k = 0; k < n; k++) {
        const int r = (self + k) % n;
        while ((i = claim(r, gen, k == 0)) >= 0) {
            g_fn(g_ctx, i);
            atomic_fetch_add(&g_done, 1);
        }
    }
}

static void *worker_main(void *arg) {
    unsigned seen = atomic_load(&g_gen);
    const int self = (int)(intptr_t)arg;
    tl_index = self;
    for (;;) {
        unsigned gen;
        double until = now_us() + g_spin_us;
        int n = 0;
        while ((gen = atomic_load(&g_gen)) == seen) {
            cpu_relax();
            if (++n % 256 == 0 && now_us() > until) {
                pthread_mutex_lock(&g_sleep_lock);
                atomic_fetch_add(&g_sleepers, 1);
                while ((gen = atomic_load(&g_gen)) == seen) pthread_cond_wait(&g_wake, &g_sleep_lock);
                atomic_fetch_sub(&g_sleepers, 1);
                pthread_mutex_unlock(&g_sleep_lock);
                break;
            }
        }
        seen = gen;
        run_items(gen, self);
    }
    return NULL;
}

static void start_workers(int n) {
    while (g_started < n - 1 && g_started < MAX_THREADS) {
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        /* attention converts float16 / int8 KV tiles on the stack (up to 128 KiB); macOS gives
           threads 512 KiB */
        pthread_attr_setstacksize(&attr, WORKER_STACK);
        if (pthread_create(&g_workers[g_started], &attr, worker_main, (void *)(intptr_t)(g_started + 1)) != 0) {
            pthread_attr_destroy(&attr);
            break;
        }
        pthread_attr_destroy(&attr);
        g_started++;
    }
}

int qm_threads(void) { return g_threads < g_started + 1 ? g_threads : g_started + 1; }

int qm_pool_threads(void) { return g_started + 1; }

int qm_worker_index(void) { return tl_index; }

void qm_pool_set_threads(int n) {
    n = n < 1 ? 1 : n > MAX_THREADS ? MAX_THREADS : n;
    start_workers(n);
    g_threads = n;
}

void qm_pool_set_spin_us(int us) { g_spin_us = us; }

void qm_parallel(int items, qm_item_fn fn, const void *ctx) {
    int n = qm_threads() < items ? qm_threads() : items;
    if (n <= 1 || (unsigned)items > RANGE_MASK) {
        for (int i = 0; i < items; i++) fn(ctx, i);
        return;
    }
    g_fn = fn;
    g_ctx = ctx;
    atomic_store_explicit(&g_nranges, n, memory_order_relaxed);
    unsigned gen = atomic_load(&g_gen) + 1;
    atomic_store(&g_done, 0);
    for (int r = 0; r < n; r++)
        atomic_store(&g_ranges[r], range_word(gen, (unsigned)((int64_t)items * r / n),
                                              (unsigned)((int64_t)items * (r + 1) / n)));
    atomic_store(&g_gen, gen);
    if (atomic_load(&g_sleepers) > 0) {
        pthread_mutex_lock(&g_sleep_lock);
        pthread_cond_broadcast(&g_wake);
        pthread_mutex_unlock(&g_sleep_lock);
    }
    run_items(gen, 0);
    while (atomic_load(&g_done) < items) cpu_relax();
}

