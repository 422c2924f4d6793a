/* The kernels' threads: one pool for the whole process, whichever thread calls.

   OpenMP (libgomp) keeps a pool of threads per calling thread: once the loading thread had run a parallel loop, a
   second thread's loops (the engine's worker, where every request runs) ran 3x slower on a 2-core machine (26 vs 9
   ms per decode step of the embedded model: with more of its threads than cores, libgomp stops spinning between
   loops and wakes its threads through the kernel for every one of the ~250 loops of a step). Here every caller
   shares one set of workers: a call takes the pool (one call at a time: two at once would only share the cores),
   hands each worker a contiguous part of [0, n), does the first part itself and spins until the others are done.
   Between calls a worker spins for SPIN_NS, then sleeps until the next call wakes it.

   The parts are fixed by n and the number of threads alone, and no result depends on them anyway: each item of
   every loop here is computed by itself (a row, a task of weight rows, one attention row). */

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

typedef void (*kvb_task)(void *ctx, int64_t begin, int64_t end);

enum { MAX_WORKERS = 255 };
static const int64_t SPIN_NS = 2000000; /* a worker spins this long after a call before it sleeps */

static pthread_mutex_t call_lock = PTHREAD_MUTEX_INITIALIZER; /* held for a whole parallel call */
static pthread_mutex_t sleep_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static int workers;                       /* started; changed under call_lock */
static int fork_handler;                  /* pthread_atfork registered */
static _Atomic uint64_t generation;       /* one more for every call: workers wait for it to move */
static _Atomic int pending;               /* workers still on the current call */
static uint64_t born_at[MAX_WORKERS + 1]; /* `generation` when worker i started: it waits for the next one */
static struct {
    kvb_task fn;
    void *ctx;
    int64_t n;
    int parts;
} job; /* written before `generation` moves (release), read after (acquire) */

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void run_part(int part) {
    const int64_t begin = job.n * part / job.parts, end = job.n * (part + 1) / job.parts;
    if (begin < end) job.fn(job.ctx, begin, end);
}

static void *worker_main(void *arg) {
    const int id = (int)(intptr_t)arg; /* 1 .. workers: part 0 is the caller's */
    uint64_t seen = born_at[id];
    for (;;) {
        uint64_t now = atomic_load_explicit(&generation, memory_order_acquire);
        if (now == seen) {
            const int64_t until = now_ns() + SPIN_NS;
            for (int spins = 1; now == seen; spins++) {
                relax();
                now = atomic_load_explicit(&generation, memory_order_acquire);
                if (now == seen && spins % 256 == 0 && now_ns() > until) {
                    pthread_mutex_lock(&sleep_lock); /* the caller moves `generation`, then broadcasts under it */
                    while ((now = atomic_load_explicit(&generation, memory_order_acquire)) == seen)
                        pthread_cond_wait(&wake, &sleep_lock);
                    pthread_mutex_unlock(&sleep_lock);
                }
            }
        }
        seen = now;
        if (id < job.parts) run_part(id);
        atomic_fetch_sub_explicit(&pending, 1, memory_order_acq_rel);
    }
    return 0;
}

/* A forked child has none of the parent's workers (only the forking thread survives a fork). */
static void after_fork_in_child(void) {
    pthread_mutex_init(&call_lock, 0);
    pthread_mutex_init(&sleep_lock, 0);
    pthread_cond_init(&wake, 0);
    workers = 0;
    atomic_store(&pending, 0);
}

/* fn(ctx, begin, end) over [0, n) split into `threads` contiguous parts (fewer when n is smaller), the caller
   taking the first; returns when every part is done. */
void kvb_parallel(int64_t n, int threads, kvb_task fn, void *ctx) {
    int parts = threads < 1 ? 1 : threads > MAX_WORKERS + 1 ? MAX_WORKERS + 1 : threads;
    if (n < parts) parts = (int)n;
    if (parts <= 1) {
        if (n > 0) fn(ctx, 0, n);
        return;
    }
    pthread_mutex_lock(&call_lock);
    if (!fork_handler) fork_handler = pthread_atfork(0, 0, after_fork_in_child) == 0;
    while (workers < parts - 1) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        born_at[workers + 1] = atomic_load_explicit(&generation, memory_order_relaxed);
        const int failed = pthread_create(&thread, &attr, worker_main, (void *)(intptr_t)(workers + 1));
        pthread_attr_destroy(&attr);
        if (failed) break;
        workers++;
    }
    if (parts > workers + 1) parts = workers + 1; /* no more threads could be had: fewer parts */
    job.fn = fn, job.ctx = ctx, job.n = n, job.parts = parts;
    atomic_store_explicit(&pending, workers, memory_order_relaxed);
    atomic_fetch_add_explicit(&generation, 1, memory_order_release);
    pthread_mutex_lock(&sleep_lock);
    pthread_cond_broadcast(&wake);
    pthread_mutex_unlock(&sleep_lock);
    run_part(0);
    while (atomic_load_explicit(&pending, memory_order_acquire) > 0) relax();
    pthread_mutex_unlock(&call_lock);
}
