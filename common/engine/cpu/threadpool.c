/* threadpool.c: a tiny fork-join pool for the CPU backend. The caller's
 * thread takes part as thread 0, so a pool of n threads starts n-1 workers.
 * One run at a time: tw_cpu_pool_run publishes (fn, ctx) under a generation
 * counter, runs its own share, and waits until every worker reports done. */
#include "common/engine/cpu/cpu_ops.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct tw_cpu_pool {
  int n_threads;
  pthread_t *threads;      /* [n_threads - 1] */
  int n_started;
  pthread_mutex_t mu;
  pthread_cond_t start_cv; /* workers wait for a new generation */
  pthread_cond_t done_cv;  /* the caller waits for n_done == n_threads - 1 */
  uint64_t generation;
  int n_done;
  int stopping;
  tw_cpu_task_fn fn;
  void *ctx;
};

typedef struct {
  tw_cpu_pool_t *pool;
  int idx;
} tw_cpu_worker_arg_t;

static void *tw_cpu_pool_worker(void *arg_v) {
  tw_cpu_worker_arg_t arg = *(tw_cpu_worker_arg_t *)arg_v;
  free(arg_v);
  tw_cpu_pool_t *pool = arg.pool;
  uint64_t seen = 0;
  for (;;) {
    pthread_mutex_lock(&pool->mu);
    while (!pool->stopping && pool->generation == seen) pthread_cond_wait(&pool->start_cv, &pool->mu);
    if (pool->stopping) {
      pthread_mutex_unlock(&pool->mu);
      return NULL;
    }
    seen = pool->generation;
    tw_cpu_task_fn fn = pool->fn;
    void *ctx = pool->ctx;
    pthread_mutex_unlock(&pool->mu);

    fn(ctx, arg.idx, pool->n_threads);

    pthread_mutex_lock(&pool->mu);
    pool->n_done++;
    if (pool->n_done == pool->n_threads - 1) pthread_cond_signal(&pool->done_cv);
    pthread_mutex_unlock(&pool->mu);
  }
}

TW_NODISCARD tw_status_t tw_cpu_pool_create(int n_threads, tw_cpu_pool_t **pool_p) {
  if (n_threads < 0) return tw_err(TW_ERR_INVALID_ARGUMENT, "cpu pool: n_threads %d < 0", n_threads);
  if (n_threads == 0) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    n_threads = n > 0 ? (int)n : 1;
  }
  tw_cpu_pool_t *pool = calloc(1, sizeof(*pool));
  if (!pool) return tw_err(TW_ERR_NO_MEMORY, "cpu pool: out of memory");
  pool->n_threads = n_threads;
  pthread_mutex_init(&pool->mu, NULL);
  pthread_cond_init(&pool->start_cv, NULL);
  pthread_cond_init(&pool->done_cv, NULL);
  if (n_threads > 1) {
    pool->threads = calloc((size_t)n_threads - 1, sizeof(pthread_t));
    if (!pool->threads) {
      tw_cpu_pool_destroy(pool);
      return tw_err(TW_ERR_NO_MEMORY, "cpu pool: out of memory");
    }
  }
  for (int i = 1; i < n_threads; i++) {
    tw_cpu_worker_arg_t *arg = malloc(sizeof(*arg));
    if (!arg) {
      tw_cpu_pool_destroy(pool);
      return tw_err(TW_ERR_NO_MEMORY, "cpu pool: out of memory");
    }
    arg->pool = pool;
    arg->idx = i;
    int rc = pthread_create(&pool->threads[i - 1], NULL, tw_cpu_pool_worker, arg);
    if (rc != 0) {
      free(arg);
      tw_cpu_pool_destroy(pool);
      return tw_err(TW_ERR_INTERNAL, "cpu pool: pthread_create: %s", strerror(rc));
    }
    pool->n_started++;
  }
  *pool_p = pool;
  return TW_OK;
}

void tw_cpu_pool_destroy(tw_cpu_pool_t *pool) {
  if (!pool) return;
  pthread_mutex_lock(&pool->mu);
  pool->stopping = 1;
  pthread_cond_broadcast(&pool->start_cv);
  pthread_mutex_unlock(&pool->mu);
  for (int i = 0; i < pool->n_started; i++) pthread_join(pool->threads[i], NULL);
  pthread_cond_destroy(&pool->start_cv);
  pthread_cond_destroy(&pool->done_cv);
  pthread_mutex_destroy(&pool->mu);
  free(pool->threads);
  free(pool);
}

int tw_cpu_pool_size(const tw_cpu_pool_t *pool) { return pool ? pool->n_threads : 1; }

void tw_cpu_pool_run(tw_cpu_pool_t *pool, tw_cpu_task_fn fn, void *ctx) {
  if (!pool || pool->n_threads == 1) {
    fn(ctx, 0, 1);
    return;
  }
  pthread_mutex_lock(&pool->mu);
  pool->fn = fn;
  pool->ctx = ctx;
  pool->n_done = 0;
  pool->generation++;
  pthread_cond_broadcast(&pool->start_cv);
  pthread_mutex_unlock(&pool->mu);

  fn(ctx, 0, pool->n_threads);

  pthread_mutex_lock(&pool->mu);
  while (pool->n_done < pool->n_threads - 1) pthread_cond_wait(&pool->done_cv, &pool->mu);
  pthread_mutex_unlock(&pool->mu);
}
