/* What the C files of the _qmatmul extension share: its thread pool, the instruction set chosen
   at run time, and the entry points of the fused CPU ops (_cpu_ops.c) listed in the module. */
#ifndef EDGESERVE_QMATMUL_H
#define EDGESERVE_QMATMUL_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>

#if defined(__x86_64__) || defined(__i386__)
#define QM_X86 1
#include <immintrin.h>
#endif

/* One call's work: items 0..n-1, run in any order, on any thread of the pool. */
typedef void (*qm_item_fn)(const void *ctx, int item);

/* Held by each Python entry point while it runs (with the GIL released): one call owns the pool. */
extern pthread_mutex_t qm_call_lock;

/* Runs fn(ctx, i) for every item on the pool and the calling thread; call with qm_call_lock held. */
void qm_parallel(int items, qm_item_fn fn, const void *ctx);

/* Threads one call may use, the caller's included. */
int qm_threads(void);

/* The code path chosen (by CPU features or set_isa): 2 AVX-512, 1 AVX2, 0 portable C. */
int qm_isa_level(void);

PyObject *qm_py_attention(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *qm_py_rms_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *qm_py_rope(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *qm_py_silu_mul(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *qm_py_write_kv(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

#endif
