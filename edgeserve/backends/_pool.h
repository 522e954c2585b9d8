/* The thread pool of the _qmatmul extension (_pool.c): one call at a time owns it. */
#ifndef EDGESERVE_POOL_H
#define EDGESERVE_POOL_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>

/* One call's work: items 0..n-1, run in any order, on any thread of the pool. */
typedef void (*qm_item_fn)(const void *ctx, int item);

/* Held by each Python entry point while it runs (with the GIL released): one call owns the pool. */
extern pthread_mutex_t qm_call_lock;

/* Runs the statements with the GIL released and the pool held: how every Python entry point calls
   into the C ops (a variadic macro, so that the statements may hold commas). */
#define WITH_POOL(...)                   \
    do {                                 \
        Py_BEGIN_ALLOW_THREADS           \
        pthread_mutex_lock(&qm_call_lock); \
        __VA_ARGS__;                     \
        pthread_mutex_unlock(&qm_call_lock); \
        Py_END_ALLOW_THREADS             \
    } while (0)

/* Runs fn(ctx, i) for every item on the pool and the calling thread; call with qm_call_lock held. */
void qm_parallel(int items, qm_item_fn fn, const void *ctx);

/* Threads one call may use, the caller's included. */
int qm_threads(void);

/* Threads that may run a call's items: every worker started (after a smaller set_threads too), and the caller. */
int qm_pool_threads(void);

/* The running thread's index, below qm_pool_threads(): 0 for the caller of qm_parallel, 1.. for workers (so an
   item can use its thread's own scratch). */
int qm_worker_index(void);

/* Use n threads per call (1..64, the caller's included), starting workers as needed; with qm_call_lock held. */
void qm_pool_set_threads(int n);

/* How long idle workers spin before they sleep, in microseconds. */
void qm_pool_set_spin_us(int us);

#endif
