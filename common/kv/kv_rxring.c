/* kv_rxring.c: the receiving side's bounce ring of the staged KV handoff
 * (kv_rxring.h). */
#include "common/kv/kv_rxring.h"

#include "common/kv/kv_ring.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef enum { TW_SLOT_FREE = 0, TW_SLOT_FILLING = 1, TW_SLOT_COPYING = 2 } tw_slot_state_t;

typedef struct {
  tw_slot_state_t state;
  int64_t offset, len;
  uint32_t tag;
} tw_rxslot_t;

/* Bytes of handoff `tag` copied into one (layer, block). */
typedef struct {
  uint32_t tag;
  uint32_t bytes;
} tw_rxblock_t;

struct tw_kv_rxring {
  tw_kv_rxring_params_t p;
  tw_rxslot_t *slots;
  tw_rxblock_t *blocks; /* [n_layers][n_blocks] */
  int32_t next;         /* where the search for a free slot starts (round robin) */
  int64_t t_busy_ns;    /* when the ring went from idle to busy */
  tw_kv_rxring_stats_t stats;
};

static int64_t tw_rx_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static TW_NODISCARD tw_status_t tw_env_int(const char *name, long lo, long hi, long def,
                                           long *out) {
  const char *v = getenv(name);
  *out = def;
  if (!v || !*v) return TW_OK;
  char *end = NULL;
  errno = 0;
  long n = strtol(v, &end, 10);
  if (errno || *end || n < lo || n > hi)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "%s=%s: expected a whole number from %ld to %ld", name,
                  v, lo, hi);
  *out = n;
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_kv_rxring_size_from_env(int32_t *n_slots_p, int64_t *slot_bytes_p) {
  long n = 0, mb = 0;
  TW_CHECK(tw_env_int("TWAIN_KV_STAGING_SLOTS", 2, 1024, TW_KV_RXRING_DEFAULT_SLOTS, &n));
  TW_CHECK(tw_env_int("TWAIN_KV_STAGING_SLOT_MB", 1, 1024, TW_KV_RXRING_DEFAULT_SLOT_MB, &mb));
  *n_slots_p = (int32_t)n;
  *slot_bytes_p = (int64_t)mb << 20;
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_kv_rxring_create(const tw_kv_rxring_params_t *p,
                                             tw_kv_rxring_t **ring_p) {
  *ring_p = NULL;
  if (!p->pool || !p->slots_mem || p->n_slots < 1 || p->slot_bytes <= 0 || p->n_layers < 1 ||
      p->n_blocks < 1 || p->block_bytes <= 0 || p->block_bytes > INT32_MAX ||
      p->layer_stride_bytes < p->block_bytes * p->n_blocks ||
      (p->ring_blocks <= 0 &&
       p->total_bytes < p->layer_stride_bytes * (p->n_layers - 1) + p->block_bytes * p->n_blocks) ||
      (p->ring_blocks > 0 &&
       (p->n_ring_blocks < 1 || p->n_ring_blocks > p->n_blocks ||
        p->total_bytes < tw_kv_pool_bytes_of(p->n_layers, p->block_bytes, p->n_blocks,
                                             p->n_ring_blocks, p->ring_blocks, p->ring_layers))) ||
      !p->copy.start || !p->copy.poll)
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "kv staging ring: bad parameters (%d slots of %lld bytes, %d layers x %d blocks "
                  "of %lld bytes, layer stride %lld)",
                  p->n_slots, (long long)p->slot_bytes, p->n_layers, p->n_blocks,
                  (long long)p->block_bytes, (long long)p->layer_stride_bytes);
  tw_kv_rxring_t *r = calloc(1, sizeof *r);
  if (r) {
    r->slots = calloc((size_t)p->n_slots, sizeof *r->slots);
    r->blocks = calloc((size_t)p->n_layers * (size_t)p->n_blocks, sizeof *r->blocks);
  }
  if (!r || !r->slots || !r->blocks) {
    tw_kv_rxring_destroy(r);
    return tw_err(TW_ERR_NO_MEMORY, "kv staging ring: cannot allocate counters for %d x %d blocks",
                  p->n_layers, p->n_blocks);
  }
  r->p = *p;
  *ring_p = r;
  return TW_OK;
}

void tw_kv_rxring_destroy(tw_kv_rxring_t *r) {
  if (!r) return;
  free(r->slots);
  free(r->blocks);
  free(r);
}

static void tw_rx_slot_free(tw_kv_rxring_t *r, int32_t k) {
  r->slots[k].state = TW_SLOT_FREE;
  if (--r->stats.slots_in_use == 0)
    r->stats.busy_seconds += (double)(tw_rx_now_ns() - r->t_busy_ns) * 1e-9;
}

TW_NODISCARD tw_status_t tw_kv_rxring_acquire(tw_kv_rxring_t *r, int64_t offset, int64_t len,
                                              uint32_t tag, int32_t *slot_p, void **buf_p) {
  if (len <= 0 || len > r->p.slot_bytes || offset < 0 || offset > r->p.total_bytes - len)
    return tw_err(TW_ERR_INVALID_ARGUMENT,
                  "kv staging: a piece of %lld bytes at offset %lld does not fit a %lld-byte slot "
                  "and the %lld-byte pool",
                  (long long)len, (long long)offset, (long long)r->p.slot_bytes,
                  (long long)r->p.total_bytes);
  for (int32_t i = 0; i < r->p.n_slots; i++) {
    int32_t k = (r->next + i) % r->p.n_slots;
    if (r->slots[k].state != TW_SLOT_FREE) continue;
    r->slots[k] = (tw_rxslot_t){.state = TW_SLOT_FILLING, .offset = offset, .len = len, .tag = tag};
    r->next = (k + 1) % r->p.n_slots;
    if (r->stats.slots_in_use++ == 0) r->t_busy_ns = tw_rx_now_ns();
    if (r->stats.slots_in_use > r->stats.slots_peak) r->stats.slots_peak = r->stats.slots_in_use;
    *slot_p = k;
    *buf_p = r->p.slots_mem + (int64_t)k * r->p.slot_bytes;
    return TW_OK;
  }
  r->stats.full_waits++;
  return TW_INPROGRESS;
}

TW_NODISCARD tw_status_t tw_kv_rxring_filled(tw_kv_rxring_t *r, int32_t k, bool ok) {
  if (k < 0 || k >= r->p.n_slots || r->slots[k].state != TW_SLOT_FILLING)
    return tw_err(TW_ERR_INVALID_ARGUMENT, "kv staging: slot %d was not being filled", k);
  tw_rxslot_t *s = &r->slots[k];
  if (!ok) {
    r->stats.pieces_failed++;
    tw_rx_slot_free(r, k);
    return TW_OK;
  }
  tw_status_t st = r->p.copy.start(r->p.copy.ctx, k, (char *)r->p.pool + s->offset,
                                   r->p.slots_mem + (int64_t)k * r->p.slot_bytes, (size_t)s->len);
  if (st != TW_OK) {
    r->stats.pieces_failed++;
    tw_rx_slot_free(r, k);
    return st;
  }
  s->state = TW_SLOT_COPYING;
  return TW_OK;
}

/* Count the bytes [off, off + len) of handoff `tag` as copied, block by
 * block (a piece may span blocks, or be part of one). */
static void tw_rx_credit(tw_kv_rxring_t *r, int64_t off, int64_t len, uint32_t tag) {
  const tw_kv_rxring_params_t *p = &r->p;
  while (len > 0) {
    int64_t layer = off / p->layer_stride_bytes, in_layer = off % p->layer_stride_bytes;
    if (p->ring_blocks > 0) /* layers of two sizes, unpadded (kv_ring.h) */
      layer = tw_kv_layer_at(off, p->n_layers, p->block_bytes, p->n_blocks, p->n_ring_blocks,
                             p->ring_blocks, p->ring_layers, &in_layer);
    int64_t b = in_layer / p->block_bytes, in_block = in_layer % p->block_bytes;
    int64_t take = p->block_bytes - in_block < len ? p->block_bytes - in_block : len;
    if (layer < p->n_layers && b < p->n_blocks) { /* else padding between layers */
      tw_rxblock_t *c = &r->blocks[layer * p->n_blocks + b];
      if (c->tag != tag) *c = (tw_rxblock_t){.tag = tag, .bytes = 0};
      uint64_t sum = (uint64_t)c->bytes + (uint64_t)take;
      c->bytes = sum > UINT32_MAX ? UINT32_MAX : (uint32_t)sum;
    }
    off += take;
    len -= take;
  }
}

TW_NODISCARD tw_status_t tw_kv_rxring_poll(tw_kv_rxring_t *r, int32_t *freed_p) {
  tw_status_t first = TW_OK;
  int32_t freed = 0;
  for (int32_t k = 0; k < r->p.n_slots; k++) {
    tw_rxslot_t *s = &r->slots[k];
    if (s->state != TW_SLOT_COPYING) continue;
    tw_status_t st = r->p.copy.poll(r->p.copy.ctx, k);
    if (st == TW_INPROGRESS) continue;
    if (st == TW_OK) {
      tw_rx_credit(r, s->offset, s->len, s->tag);
      r->stats.bytes_landed += s->len;
      r->stats.pieces++;
    } else {
      r->stats.pieces_failed++;
      if (first == TW_OK) first = st;
    }
    tw_rx_slot_free(r, k);
    freed++;
  }
  if (freed_p) *freed_p = freed;
  return first;
}

TW_NODISCARD tw_status_t tw_kv_rxring_drain(tw_kv_rxring_t *r, int timeout_ms) {
  int64_t deadline = tw_rx_now_ns() + (int64_t)timeout_ms * 1000000;
  tw_status_t first = TW_OK;
  for (;;) {
    tw_status_t st = tw_kv_rxring_poll(r, NULL);
    if (first == TW_OK) first = st;
    bool copying = false;
    for (int32_t k = 0; k < r->p.n_slots; k++) copying |= r->slots[k].state == TW_SLOT_COPYING;
    if (!copying) return first;
    if (tw_rx_now_ns() > deadline)
      return tw_err(TW_ERR_DEADLINE, "kv staging: copies still running after %d ms", timeout_ms);
    struct timespec ts = {0, 100000};
    nanosleep(&ts, NULL);
  }
}

TW_NODISCARD tw_status_t tw_kv_rxring_landed(const tw_kv_rxring_t *r, uint32_t tag,
                                             const int32_t *ids, int32_t n, const int32_t *firsts) {
  const tw_kv_rxring_params_t *p = &r->p;
  tw_status_t st = TW_OK;
  for (int32_t l = 0; l < p->n_layers; l++) {
    int32_t ring = tw_kv_layer_ring(p->ring_layers, p->ring_blocks, l); /* kv_ring.h */
    for (int32_t i = tw_kv_ring_first(firsts ? firsts[l] : 0, n, ring); i < n; i++) {
      int32_t id = ids[tw_kv_ring_entry(i, ring)];
      if (id < 0 || id >= (ring ? p->n_ring_blocks : p->n_blocks))
        return tw_err(TW_ERR_INVALID_ARGUMENT, "kv staging: block %d outside the pool of %d", id,
                      ring ? p->n_ring_blocks : p->n_blocks);
      const tw_rxblock_t *c = &r->blocks[(int64_t)l * p->n_blocks + id];
      if (c->tag != tag || c->bytes < (uint32_t)p->block_bytes) st = TW_INPROGRESS;
    }
  }
  return st;
}

void tw_kv_rxring_stats(const tw_kv_rxring_t *r, tw_kv_rxring_stats_t *out) {
  *out = r->stats;
  if (r->stats.slots_in_use > 0)
    out->busy_seconds += (double)(tw_rx_now_ns() - r->t_busy_ns) * 1e-9;
}

int32_t tw_kv_rxring_slots(const tw_kv_rxring_t *r) { return r->p.n_slots; }
int64_t tw_kv_rxring_slot_bytes(const tw_kv_rxring_t *r) { return r->p.slot_bytes; }
