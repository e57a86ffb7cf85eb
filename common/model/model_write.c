/* model_write.c: tw_model_write_synthetic: a checkpoint on disk in the
 * Hugging Face layout (spec §3.1, §3.2: model-0000k-of-0000N.safetensors
 * shards, model.safetensors.index.json) with the synthetic values of
 * model_synthetic.c. Streaming: each shard is created at its full size, then
 * the filling threads pwrite 4 MiB chunks into it, so memory stays at one
 * chunk buffer per thread whatever the model size. */
#include "common/model/model.h"

#include "common/base/log.h"
#include "common/model/model_impl.h"

#include <cjson/cJSON.h>

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef struct {
  const tw_syn_tensor_t *base;
  const int *fd_of;   /* [n tensors] the shard fd of each tensor */
  atomic_llong done;  /* bytes written */
  int64_t total;
  atomic_int next_report; /* percent */
  double t0;
} tw_write_ctx_t;

static double tw_write_now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static TW_NODISCARD tw_status_t tw_write_sink(void *arg, const tw_syn_tensor_t *t, int64_t off,
                                              const uint8_t *buf, int64_t n) {
  tw_write_ctx_t *c = arg;
  int fd = c->fd_of[t - c->base];
  int64_t at = t->user + off;
  for (int64_t w = 0; w < n;) {
    ssize_t k = pwrite(fd, buf + w, (size_t)(n - w), (off_t)(at + w));
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0)
      return tw_err(TW_ERR_IO, "writing %s: %s", t->spec->name, k < 0 ? strerror(errno) : "short write");
    w += k;
  }
  int64_t done = atomic_fetch_add(&c->done, n) + n;
  int pct = (int)(done * 100 / (c->total ? c->total : 1));
  int want = atomic_load(&c->next_report);
  if (pct >= want && atomic_compare_exchange_strong(&c->next_report, &want, pct / 10 * 10 + 10)) {
    double dt = tw_write_now_s() - c->t0;
    TW_INFO("ckpt", "written %3d%% (%.2f of %.2f GiB, %.0f MiB/s)", pct, (double)done / (1 << 30),
            (double)c->total / (1 << 30), dt > 0 ? (double)done / (1 << 20) / dt : 0.0);
  }
  return TW_OK;
}

/* The safetensors header of tensors [a, b) (data offsets from 0), padded
 * with spaces to a multiple of 8 (safetensors format). */
static char *tw_write_header(const tw_syn_tensor_t *ts, int64_t a, int64_t b) {
  cJSON *h = cJSON_CreateObject();
  cJSON *meta = cJSON_AddObjectToObject(h, "__metadata__");
  cJSON_AddStringToObject(meta, "format", "pt");
  int64_t off = 0;
  for (int64_t i = a; i < b; i++) {
    const tw_tensor_spec_t *sp = ts[i].spec;
    cJSON *e = cJSON_AddObjectToObject(h, sp->name);
    cJSON_AddStringToObject(e, "dtype", tw_dtype_name(sp->dtype));
    cJSON *shape = cJSON_AddArrayToObject(e, "shape");
    for (int d = 0; d < sp->ndim; d++) cJSON_AddItemToArray(shape, cJSON_CreateNumber((double)sp->shape[d]));
    cJSON *o = cJSON_AddArrayToObject(e, "data_offsets");
    cJSON_AddItemToArray(o, cJSON_CreateNumber((double)off));
    cJSON_AddItemToArray(o, cJSON_CreateNumber((double)(off + ts[i].n_bytes)));
    off += ts[i].n_bytes;
  }
  char *txt = cJSON_PrintUnformatted(h);
  cJSON_Delete(h);
  if (!txt) return NULL;
  size_t len = strlen(txt), padded = (len + 7) / 8 * 8;
  char *out = realloc(txt, padded + 1);
  if (!out) {
    free(txt);
    return NULL;
  }
  memset(out + len, ' ', padded - len);
  out[padded] = '\0';
  return out;
}

static TW_NODISCARD tw_status_t tw_write_all(int fd, const void *p, size_t n, const char *path) {
  const uint8_t *b = p;
  while (n) {
    ssize_t k = write(fd, b, n);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return tw_err(TW_ERR_IO, "%s: write failed: %s", path, k < 0 ? strerror(errno) : "short write");
    b += k;
    n -= (size_t)k;
  }
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_model_write_synthetic(const tw_model_config_t *config, const char *dir,
                                                  uint64_t seed, int64_t max_shard_bytes,
                                                  int threads, bool plan_only,
                                                  tw_model_write_info_t *info) {
  if (!config || !dir || max_shard_bytes <= 0)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "write checkpoint: NULL argument or shard size <= 0");
  if (!config->mxfp4 || config->hidden % 32 || config->intermediate % 32)
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "write checkpoint: the MXFP4 layout needs mxfp4 experts and hidden and "
                  "intermediate sizes that are multiples of 32 (got %d, %d)",
                  config->hidden, config->intermediate);
  tw_model_t *m = NULL;
  TW_CHECK(tw_model_alloc(config, &m));
  for (int l = 0; l < config->n_layers; l++) m->layers[l].experts_format = TW_EXPERTS_MXFP4;
  tw_model_specs_t specs = {NULL, 0};
  tw_syn_tensor_t *ts = NULL;
  int *fd_of = NULL, *shard_of = NULL, *fds = NULL;
  int n_shards = 0;
  cJSON *index = NULL;
  char path[4096];
  tw_status_t st = tw_model_specs_build(config, m, &specs);
  if (st != TW_OK) goto out;
  ts = calloc((size_t)specs.n, sizeof *ts);
  fd_of = calloc((size_t)specs.n, sizeof *fd_of);
  shard_of = calloc((size_t)specs.n, sizeof *shard_of);
  fds = calloc((size_t)specs.n, sizeof *fds);
  if (!ts || !fd_of || !shard_of || !fds) {
    st = tw_err(TW_ERR_NO_MEMORY, "write checkpoint: out of memory");
    goto out;
  }
  for (int64_t i = 0; i < specs.n; i++) fds[i] = -1;
  /* shards: tensors in file order, a new shard when the next would pass the limit */
  int64_t total = 0, in_shard = 0;
  for (int64_t i = 0; i < specs.n; i++) {
    int64_t n = tw_tensor_spec_bytes(&specs.specs[i]);
    ts[i].spec = &specs.specs[i];
    ts[i].n_bytes = n;
    if (i == 0 || (in_shard > 0 && in_shard + n > max_shard_bytes)) {
      n_shards++;
      in_shard = 0;
    }
    shard_of[i] = n_shards - 1;
    ts[i].user = in_shard; /* data offset in its shard; the header length is added below */
    in_shard += n;
    total += n;
  }
  if (info) {
    info->total_bytes = total;
    info->n_tensors = specs.n;
    info->n_shards = n_shards;
    info->seconds = 0;
  }
  if (plan_only) goto out;
  if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
    st = tw_err(TW_ERR_IO, "write checkpoint: cannot create %s: %s", dir, strerror(errno));
    goto out;
  }
  index = cJSON_CreateObject();
  cJSON_AddNumberToObject(cJSON_AddObjectToObject(index, "metadata"), "total_size", (double)total);
  cJSON *wm = cJSON_AddObjectToObject(index, "weight_map");
  double t0 = tw_write_now_s();
  for (int s = 0, i = 0; s < n_shards; s++) {
    int a = i;
    while (i < specs.n && shard_of[i] == s) i++;
    /* the Hugging Face naming: indices from 0, the suffix is the last index */
    char name[64];
    snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", s, n_shards - 1);
    snprintf(path, sizeof path, "%s/%s", dir, name);
    char *hdr = tw_write_header(ts, a, i);
    if (!hdr) {
      st = tw_err(TW_ERR_NO_MEMORY, "write checkpoint: out of memory (header)");
      goto out;
    }
    uint64_t hlen = strlen(hdr);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
      free(hdr);
      st = tw_err(TW_ERR_IO, "write checkpoint: cannot create %s: %s", path, strerror(errno));
      goto out;
    }
    fds[s] = fd;
    uint8_t len8[8];
    for (int k = 0; k < 8; k++) len8[k] = (uint8_t)(hlen >> (8 * k)); /* little-endian u64 */
    st = tw_write_all(fd, len8, 8, path);
    if (st == TW_OK) st = tw_write_all(fd, hdr, hlen, path);
    free(hdr);
    int64_t end = 8 + (int64_t)hlen + (i > a ? ts[i - 1].user + ts[i - 1].n_bytes : 0);
    if (st == TW_OK && ftruncate(fd, (off_t)end) != 0)
      st = tw_err(TW_ERR_IO, "write checkpoint: %s: cannot size it to %lld bytes: %s", path,
                  (long long)end, strerror(errno));
    if (st != TW_OK) goto out;
    for (int k = a; k < i; k++) {
      ts[k].user += 8 + (int64_t)hlen;
      fd_of[k] = fd;
      cJSON_AddStringToObject(wm, specs.specs[k].name, name);
    }
  }
  tw_write_ctx_t ctx = {.base = ts, .fd_of = fd_of, .total = total, .t0 = t0};
  atomic_init(&ctx.done, 0);
  atomic_init(&ctx.next_report, 10);
  int used = 1;
  TW_INFO("ckpt", "writing %d shards, %lld tensors, %.2f GiB to %s", n_shards,
          (long long)specs.n, (double)total / (1 << 30), dir);
  st = tw_synthetic_fill(ts, specs.n, seed, threads, tw_write_sink, &ctx, &used);
  if (st != TW_OK) goto out;
  for (int s = 0; s < n_shards; s++) {
    if (close(fds[s]) != 0 && st == TW_OK)
      st = tw_err(TW_ERR_IO, "write checkpoint: closing shard %d: %s", s, strerror(errno));
    fds[s] = -1;
  }
  if (st != TW_OK) goto out;
  snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
  char *txt = cJSON_Print(index);
  FILE *f = txt ? fopen(path, "w") : NULL;
  if (!f || fputs(txt, f) < 0 || fputc('\n', f) < 0)
    st = tw_err(TW_ERR_IO, "write checkpoint: cannot write %s: %s", path, strerror(errno));
  if (f && fclose(f) != 0 && st == TW_OK)
    st = tw_err(TW_ERR_IO, "write checkpoint: cannot write %s: %s", path, strerror(errno));
  free(txt);
  double dt = tw_write_now_s() - t0;
  if (info) info->seconds = dt;
  if (st == TW_OK)
    TW_INFO("ckpt", "wrote %.2f GiB in %.1f s (%.0f MiB/s, %d threads), seed %llu",
            (double)total / (1 << 30), dt, dt > 0 ? (double)total / (1 << 20) / dt : 0.0, used,
            (unsigned long long)seed);
out:
  for (int s = 0; fds && s < n_shards; s++)
    if (fds[s] >= 0) close(fds[s]);
  cJSON_Delete(index);
  free(ts);
  free(fd_of);
  free(shard_of);
  free(fds);
  tw_model_specs_fini(&specs);
  tw_model_destroy(m);
  return st;
}
