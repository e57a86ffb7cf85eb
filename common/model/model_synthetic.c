/* model_synthetic.c: tw_model_synthetic: weights with the real shapes and
 * dtypes of a config and seeded random values of realistic scale, for
 * benchmarks without a checkpoint. One anonymous mapping holds every tensor
 * (one arena per lifetime), filled by tw_synthetic_fill: one thread per core
 * in 4 MiB chunks, each chunk with its own RNG stream seeded by (seed, chunk),
 * so the values do not depend on the thread count. The same fill writes
 * random checkpoints to disk (`twain write-checkpoint`, router/cli/cli_ckpt.c),
 * so a checkpoint written with a seed loads as the synthetic model of that
 * seed, byte for byte. */
#include "common/model/model.h"

#include "common/base/log.h"
#include "common/model/model_impl.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define TW_SYN_ALIGN 256
#define TW_SYN_MAX_THREADS 64

typedef struct {
  tw_syn_tensor_t *tensors;
  int64_t n_tensors;
  int64_t n_chunks;
  uint64_t seed;
  tw_syn_sink_fn sink;
  void *ctx;
  atomic_llong next_chunk;
  atomic_int failed;
  tw_status_t st; /* the first error (under `failed`) */
  char msg[512];
} tw_syn_job_t;

static uint64_t splitmix64(uint64_t *s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* xorshift64* for the bulk; seeded from splitmix64. */
static inline uint64_t rng_next(uint64_t *s) {
  uint64_t x = *s;
  x ^= x >> 12;
  x ^= x << 25;
  x ^= x >> 27;
  *s = x;
  return x * 0x2545f4914f6cdd1dull;
}

/* Approximately N(0, 1): Irwin-Hall sum of four 16-bit uniforms from one
 * 64-bit draw, scaled to unit variance (range +-3.46). Exact normality does
 * not matter for benchmarks; speed does: ~2 ns per value versus ~30 ns for
 * Box-Muller's log/sqrt/sincos (a 1 GB 20b-shaped fill on this 2-core
 * machine went from 7.5 s to 1.0 s). */
static inline float rng_normal(uint64_t *s) {
  uint64_t r = rng_next(s);
  uint32_t sum = (uint32_t)(r & 0xffff) + (uint32_t)((r >> 16) & 0xffff) +
                 (uint32_t)((r >> 32) & 0xffff) + (uint32_t)(r >> 48);
  return ((float)sum - 131070.0f) * (1.7320508f / 65536.0f);
}

/* n bytes of tensor t's global chunk `chunk` into p. */
static void fill_chunk(const tw_syn_tensor_t *t, int64_t chunk, uint64_t seed, uint8_t *p,
                       int64_t n) {
  uint64_t sm = seed ^ ((uint64_t)chunk * 0xd1342543de82ef95ull);
  uint64_t s = splitmix64(&sm) | 1;
  switch (t->spec->init) {
    case TW_INIT_FP4: {
      int64_t i = 0;
      for (; i + 8 <= n; i += 8) {
        uint64_t r = rng_next(&s);
        memcpy(p + i, &r, 8);
      }
      for (; i < n; i++) p[i] = (uint8_t)rng_next(&s);
      break;
    }
    case TW_INIT_SCALE:
      /* 2^-9..2^-5: FP4 values up to 6 give weights of about |w| <= 0.19,
       * typically ~0.02 like the bf16 weights */
      for (int64_t i = 0; i < n; i++) p[i] = (uint8_t)(118 + (rng_next(&s) >> 33) % 5);
      break;
    default: {
      float mean = t->spec->init == TW_INIT_NORM ? 1.0f : 0.0f;
      float sd = t->spec->init == TW_INIT_SINK ? 1.0f : 0.02f;
      /* the router: logits z = W t of a normed t (rms ~1) get sd ~2, so the
       * top-k choice is decisive (a trained router's softmax is peaked)
       * while every expert's logit has the same law: balanced on average */
      if (t->spec->init == TW_INIT_ROUTER && t->spec->ndim == 2 && t->spec->shape[1] > 0)
        sd = 2.0f / sqrtf((float)t->spec->shape[1]);
      uint16_t *h = (uint16_t *)p;
      int64_t n_el = n / 2;
      for (int64_t i = 0; i < n_el; i++) h[i] = tw_f32_to_bf16(mean + sd * rng_normal(&s));
      break;
    }
  }
}

static void *fill_worker(void *arg) {
  tw_syn_job_t *job = arg;
  uint8_t *buf = NULL;
  int64_t t = 0;
  while (!atomic_load(&job->failed)) {
    int64_t c = atomic_fetch_add(&job->next_chunk, 1);
    if (c >= job->n_chunks) break;
    while (t + 1 < job->n_tensors && job->tensors[t + 1].first_chunk <= c) t++;
    /* chunks are claimed in increasing order, but other threads move ahead:
     * the search above only ever moves forward for this thread */
    const tw_syn_tensor_t *x = &job->tensors[t];
    int64_t off = (c - x->first_chunk) * TW_SYN_CHUNK_BYTES;
    int64_t n = x->n_bytes - off < TW_SYN_CHUNK_BYTES ? x->n_bytes - off : TW_SYN_CHUNK_BYTES;
    if (x->data) {
      fill_chunk(x, c, job->seed, x->data + off, n);
      continue;
    }
    if (!buf && !(buf = malloc((size_t)TW_SYN_CHUNK_BYTES))) {
      if (atomic_exchange(&job->failed, 1) == 0)
        job->st = tw_err(TW_ERR_NO_MEMORY, "synthetic fill: cannot allocate a chunk buffer");
      break;
    }
    fill_chunk(x, c, job->seed, buf, n);
    tw_status_t st = job->sink(job->ctx, x, off, buf, n);
    if (st != TW_OK && atomic_exchange(&job->failed, 1) == 0) {
      job->st = st;
      snprintf(job->msg, sizeof job->msg, "%s", tw_last_error());
    }
  }
  free(buf);
  return NULL;
}

TW_NODISCARD tw_status_t tw_synthetic_fill(tw_syn_tensor_t *ts, int64_t n_tensors, uint64_t seed,
                                           int max_threads, tw_syn_sink_fn sink, void *ctx,
                                           int *threads_p) {
  int64_t chunks = 0;
  for (int64_t i = 0; i < n_tensors; i++) {
    ts[i].first_chunk = chunks;
    chunks += (ts[i].n_bytes + TW_SYN_CHUNK_BYTES - 1) / TW_SYN_CHUNK_BYTES;
    if (!ts[i].data && !sink)
      return tw_err(TW_ERR_INVALID_ARGUMENT, "synthetic fill: %s has no data and no sink",
                    ts[i].spec->name);
  }
  tw_syn_job_t job;
  memset(&job, 0, sizeof job);
  job.tensors = ts;
  job.n_tensors = n_tensors;
  job.n_chunks = chunks;
  job.seed = seed;
  job.sink = sink;
  job.ctx = ctx;
  job.st = TW_OK;
  atomic_init(&job.next_chunk, 0);
  atomic_init(&job.failed, 0);
  long n_cpu = sysconf(_SC_NPROCESSORS_ONLN);
  int n_threads = max_threads > 0 ? max_threads : n_cpu < 1 ? 1 : (int)n_cpu;
  if (n_threads > TW_SYN_MAX_THREADS) n_threads = TW_SYN_MAX_THREADS;
  if (n_threads > chunks) n_threads = chunks > 0 ? (int)chunks : 1;
  pthread_t tids[TW_SYN_MAX_THREADS];
  int started = 0;
  for (; started < n_threads; started++)
    if (pthread_create(&tids[started], NULL, fill_worker, &job) != 0) break;
  if (started == 0) fill_worker(&job); /* no thread could start: fill here */
  for (int i = 0; i < started; i++) pthread_join(tids[i], NULL);
  if (threads_p) *threads_p = started ? started : 1;
  if (job.st != TW_OK && job.msg[0]) return tw_err(job.st, "%s", job.msg);
  return job.st;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

TW_NODISCARD tw_status_t tw_model_synthetic(const tw_model_config_t *config, uint64_t seed,
                                            tw_model_t **model_p) {
  if (!config || !model_p)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "model synthetic: NULL argument");
  if (config->n_layers <= 0 || config->n_layers > TW_MAX_LAYERS || config->hidden <= 0 ||
      config->intermediate <= 0 || config->n_experts <= 0 || config->vocab_size <= 0 ||
      config->head_dim <= 0 || config->n_heads <= 0 || config->n_kv_heads <= 0)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "model synthetic: config has non-positive sizes");
  if (config->mxfp4 && (config->hidden % 32 || config->intermediate % 32))
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "model synthetic: MXFP4 needs hidden and intermediate multiples of 32");
  const double t0 = now_s();
  tw_model_t *m = NULL;
  TW_CHECK(tw_model_alloc(config, &m));
  tw_model_impl_t *impl = m->impl;
  for (int l = 0; l < config->n_layers; l++)
    m->layers[l].experts_format = config->mxfp4 ? TW_EXPERTS_MXFP4 : TW_EXPERTS_BF16;

  tw_model_specs_t specs = {NULL, 0};
  tw_syn_tensor_t *ts = NULL;
  tw_status_t st = tw_model_specs_build(config, m, &specs);
  if (st != TW_OK) goto fail;
  ts = calloc((size_t)specs.n, sizeof *ts);
  if (!ts) {
    st = tw_err(TW_ERR_NO_MEMORY, "model synthetic: out of memory");
    goto fail;
  }
  size_t total = 0;
  for (int64_t i = 0; i < specs.n; i++) {
    int64_t n = tw_tensor_spec_bytes(&specs.specs[i]);
    ts[i].spec = &specs.specs[i];
    ts[i].n_bytes = n;
    ts[i].data = (uint8_t *)(uintptr_t)total; /* offset for now */
    total += ((size_t)n + TW_SYN_ALIGN - 1) / TW_SYN_ALIGN * TW_SYN_ALIGN;
  }
  void *arena = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (arena == MAP_FAILED) {
    st = tw_err(TW_ERR_NO_MEMORY, "model synthetic: cannot map %zu bytes: %s", total,
                strerror(errno));
    goto fail;
  }
  impl->arena = arena;
  impl->arena_bytes = total;
  /* huge pages make the first-touch faults of a 65 GB fill ~500x fewer;
   * advisory, so a kernel without THP just ignores it */
  (void)madvise(arena, total, MADV_HUGEPAGE);
  for (int64_t i = 0; i < specs.n; i++) {
    ts[i].data = (uint8_t *)arena + (uintptr_t)ts[i].data;
    tw_tensor_t *v = specs.specs[i].dst;
    v->data = ts[i].data;
    v->dtype = specs.specs[i].dtype;
    v->ndim = specs.specs[i].ndim;
    memcpy(v->shape, specs.specs[i].shape, sizeof v->shape);
    v->n_bytes = ts[i].n_bytes;
    m->weight_bytes += ts[i].n_bytes;
  }
  impl->n_tensors = specs.n;
  int started = 1;
  st = tw_synthetic_fill(ts, specs.n, seed, 0, NULL, NULL, &started);
  if (st != TW_OK) goto fail;

  TW_INFO("loader", "synthetic model: %d layers, %s experts, %lld tensors, %lld bytes "
          "(%.2f GiB), seed %llu, %d threads, %.2f s",
          config->n_layers, config->mxfp4 ? "mxfp4" : "bf16", (long long)specs.n,
          (long long)m->weight_bytes, (double)m->weight_bytes / (1024.0 * 1024.0 * 1024.0),
          (unsigned long long)seed, started, now_s() - t0);
  free(ts);
  tw_model_specs_fini(&specs);
  *model_p = m;
  return TW_OK;
fail:
  free(ts);
  tw_model_specs_fini(&specs);
  tw_model_destroy(m);
  return st;
}
