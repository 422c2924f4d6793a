/* The kernels' threads: one pool for the whole process, whichever thread calls.

   OpenMP (libgomp) keeps a pool of threads per calling thread: once the loading thread had run a parallel loop, a
   second thread's loops (the engine's worker, where every request runs) ran 3x slower on a 2-core machine (26 vs 9
   ms per decode step of the embedded model: with more of its threads than cores, libgomp stops spinning between
   loops and wakes its threads through the kernel for every one of the ~250 loops of a step). Here every caller
   shares one set of workers, and a call never waits for a thread the OS has not scheduled: [0, n) is cut into
   `threads` contiguous parts that the caller and the workers claim one at a time, so when the workers are slow to
   wake (torch's own threads hold the cores where a forward mixes torch operations and ours) the caller does every
   part itself. Between calls a worker spins for SPIN_NS (a forward in C calls again microseconds later), then yields
   its core until YIELD_NS, then sleeps until a call wakes it.

   The parts are fixed by n and the number of threads alone, and no result depends on them or on who runs them:
   each item of every loop here is computed by itself (a row, a task of weight rows, one attention row). */

#include <pthread.h>
#include <sched.h>
#include <stddef.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

typedef void (*kvb_task)(void *ctx, int64_t begin, int64_t end);

enum { MAX_WORKERS = 255 };
static const int64_t SPIN_NS = 50000;  /* a worker spins this long after a call, */
static const int64_t YIELD_NS = 50000; /* then yields its core until this long after it, then sleeps */

static pthread_mutex_t call_lock = PTHREAD_MUTEX_INITIALIZER; /* held for a whole parallel call */
static pthread_mutex_t sleep_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static int workers;             /* started; changed under call_lock */
static int fork_handler;        /* pthread_atfork registered */
/* each on its own cache line: idle workers read `phase` in a loop while the caller counts parts */
static _Alignas(64) _Atomic uint64_t phase; /* even: a job is open; odd: the caller is writing the next one */
static _Alignas(64) _Atomic int inside;     /* workers inside the open job (the caller writes a new one only at 0) */
static _Alignas(64) _Atomic int next_part;  /* the next part of the open job to claim */
static _Alignas(64) _Atomic int parts_done;
static struct {
    kvb_task fn;
    void *ctx;
    int64_t n;
    int parts;
} job; /* written while `phase` is odd and no worker is inside */

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

static void claim_parts(void) {
    for (int part; (part = atomic_fetch_add(&next_part, 1)) < job.parts;) {
        const int64_t begin = job.n * part / job.parts, end = job.n * (part + 1) / job.parts;
        if (begin < end) job.fn(job.ctx, begin, end);
        atomic_fetch_add(&parts_done, 1);
    }
}

/* Waits for a job newer than `seen` to open; returns its phase. */
static uint64_t await_job(uint64_t seen) {
    uint64_t now = atomic_load(&phase);
    const int64_t start = now_ns();
    int64_t waited = 0;
    for (int spins = 1; now == seen || (now & 1); spins++) {
        if (spins % 64 == 0) waited = now_ns() - start;
        if (waited > YIELD_NS) {
            pthread_mutex_lock(&sleep_lock); /* the caller opens a job, then broadcasts under this lock */
            while ((now = atomic_load(&phase)) == seen || (now & 1)) pthread_cond_wait(&wake, &sleep_lock);
            pthread_mutex_unlock(&sleep_lock);
            return now;
        }
        if (waited > SPIN_NS) sched_yield();
        else relax();
        now = atomic_load(&phase);
    }
    return now;
}

static void *worker_main(void *arg) {
    uint64_t seen = (uint64_t)(uintptr_t)arg; /* the phase when it started: it waits for a later job */
    for (;;) {
        const uint64_t open = await_job(seen);
        atomic_fetch_add(&inside, 1);
        if (atomic_load(&phase) == open) { /* still open: its fields are whole until `inside` is 0 again */
            seen = open;
            claim_parts();
        }
        atomic_fetch_sub(&inside, 1);
    }
    return 0;
}

/* A forked child has none of the parent's workers (only the forking thread survives a fork). */
static void after_fork_in_child(void) {
    pthread_mutex_init(&call_lock, 0);
    pthread_mutex_init(&sleep_lock, 0);
    pthread_cond_init(&wake, 0);
    workers = 0;
    atomic_store(&inside, 0);
    if (atomic_load(&phase) & 1) atomic_fetch_add(&phase, 1);
}

/* fn(ctx, begin, end) over [0, n) split into `threads` contiguous parts (fewer when n is smaller), claimed by the
   caller and the pool's workers; returns when every part is done. */
void kvb_parallel(int64_t n, int threads, kvb_task fn, void *ctx) {
    int parts = threads < 1 ? 1 : threads > MAX_WORKERS + 1 ? MAX_WORKERS + 1 : threads;
    if (n < parts) parts = (int)n;
    if (parts <= 1) {
        if (n > 0) fn(ctx, 0, n);
        return;
    }
    pthread_mutex_lock(&call_lock);
    if (!fork_handler) fork_handler = pthread_atfork(0, 0, after_fork_in_child) == 0;
    atomic_fetch_add(&phase, 1); /* odd: closed; a worker that had not yet joined the last job will not */
    while (workers < parts - 1 && workers < MAX_WORKERS) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int failed = pthread_create(&thread, &attr, worker_main, (void *)(uintptr_t)(atomic_load(&phase) + 1));
        pthread_attr_destroy(&attr);
        if (failed) break; /* fewer helpers: the caller claims what they would have */
        workers++;
    }
    while (atomic_load(&inside) > 0) relax(); /* workers still leaving the last job */
    job.fn = fn, job.ctx = ctx, job.n = n, job.parts = parts;
    atomic_store(&next_part, 0);
    atomic_store(&parts_done, 0);
    atomic_fetch_add(&phase, 1); /* even: open */
    pthread_mutex_lock(&sleep_lock);
    pthread_cond_broadcast(&wake);
    pthread_mutex_unlock(&sleep_lock);
    claim_parts();
    while (atomic_load(&parts_done) < parts) relax();
    pthread_mutex_unlock(&call_lock);
}

typedef struct {
    kvb_task fn;
    char *ctxs;
    size_t size;
    const int64_t *first;
    int64_t count;
} segments_call;

static void segment_parts(void *ctx, int64_t begin, int64_t end) {
    const segments_call *call = ctx;
    for (int64_t s = 0; s < call->count; s++) {
        const int64_t from = begin > call->first[s] ? begin : call->first[s];
        const int64_t to = end < call->first[s + 1] ? end : call->first[s + 1];
        if (from < to) call->fn(call->ctxs + s * call->size, from - call->first[s], to - call->first[s]);
    }
}

/* kvb_parallel over the items of `count` jobs laid one after the other, in one call: job s (its context at
   ctxs + s * size) has items first[s] .. first[s + 1] - 1, and fn gets each part's share of them as its own item
   numbers (several weights' tasks, several requests' attention rows). */
void kvb_parallel_segments(int64_t count, const int64_t *first, kvb_task fn, void *ctxs, size_t size, int threads) {
    segments_call call = {fn, ctxs, size, first, count};
    kvb_parallel(first[count], threads, segment_parts, &call);
}
