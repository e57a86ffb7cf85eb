#!/usr/bin/env python3
"""bench_hf.py: the same shapes as twain-bench-cuda through Hugging Face
transformers, on the same machine, as a side-by-side ratio (issue 5 item 4c).

Builds transformers' GptOssForCausalLM with the real gpt-oss-20b / -120b config
(spec 1.1; the presets of tests/reference/make_reference.py) and random weights
(make_reference.randomize_: matrices N(0, 1/fan_in), router biases N(0, 0.1^2),
so tokens spread over the experts as with a trained router), all in bfloat16 on
--device. transformers' MXFP4 compute path needs the `kernels` hub package and
its downloaded Triton kernels, which the GPU machine does not have, so the
experts are plain bf16 tensors (the path transformers takes for MXFP4
checkpoints there too: dequantise to bf16); the output says which attention and
experts implementation transformers used. gpt-oss-120b in bf16 (~234 GB) does
not fit one H200: it is skipped with the reason unless --layers cuts it.

Measures, like tests/bench/bench_cuda.c:
  (a) prefill of one sequence at --prefill tokens (default 8192, 32768, 65536,
      128000): the prompt goes through model() with a DynamicCache, in chunks
      when one pass does not fit (eager attention materialises the
      [heads, chunk, context] scores; the chunk is sized from free memory, or
      --prefill-chunk), logits of the last position only (logits_to_keep=1);
      median of --reps runs at <= 8192 tokens, one run above; one untimed
      warm-up prefill first;
  (b) decode steps at --batches (default 1, 8, 32, 64, 128, 256) and
      --contexts (default 8192, 32768): the cache of the context's prefill
      (batch 1) is copied to every sequence (Cache.batch_repeat_interleave),
      then --warmup untimed and --steps timed steps of model() on one new
      token per sequence with greedy argmax (what generate() does per step);
      median step time -> tokens/s per sequence and per GPU.
Order: the prefills the decode contexts need, then decode, then the longer
prefills, so that the budget cuts the least informative points. Timing: a
device synchronisation and a host clock around each call (twain's bench does
the same). Skipped points print the reason (does not fit, over the per-point
cap, over the overall budget, out of memory); a prefill cut by the cap is
reported as a lower bound ('>').

--twain FILE (repeatable): twain's numbers, from twain-bench-cuda's log
(lines '[gpt-oss-20b] prefill   8192 tokens: 0.130 s ...' and '[...] decode
batch   1 ctx   8192: 3.193 ms/step ...') or a JSON file of this script's
format; the final table then adds twain's time and the ratio HF / twain (how
many times faster twain is). The JSON (--json, default $OUT/bench_hf.json
when OUT is set) holds every point, the software versions and the settings.

Hard overall time budget: --budget-s (default 540 s, under the device's 10
minutes per command); each point also stops at --point-cap-s. Progress lines
carry the elapsed time. --tiny --device cpu runs the same code on the tiny
checkpoint's shapes (make_reference's 'tiny' preset = the config of
shared/models/tiny-gptoss-wordnet) with small lists, to smoke-test the script wherever torch and transformers
exist. --selftest runs the planner, budget, table, JSON and twain-log parsing
on a fake model (no torch needed; CI runs it).

Examples:
  python3 tests/bench/bench_hf.py --model 20b --twain bench_20b.log --json /tmp/hf.json
  python3 tests/bench/bench_hf.py --tiny --device cpu --budget-s 60
"""
import argparse
import contextlib
import copy
import gc
import json
import os
import re
import statistics
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))
import make_reference as mr  # noqa: E402  (torch-free at import)

T0 = time.time()


def say(msg):
    print("[hf +%6.1fs] %s" % (time.time() - T0, msg), flush=True)


def int_list(s):
    return [int(x) for x in s.split(",") if x.strip()] if s else []


def parse_args(argv):
    p = argparse.ArgumentParser(description="gpt-oss through Hugging Face transformers with twain's "
                                "benchmark shapes (prefill latency, decode tokens/s), side by side "
                                "with twain-bench-cuda.",
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model", default="20b", choices=["20b", "120b", "both"],
                   help="real-shape model(s) to build (default 20b; 120b does not fit in bf16)")
    p.add_argument("--tiny", action="store_true",
                   help="the tiny checkpoint's shapes and small point lists (a smoke test)")
    p.add_argument("--device", default="cuda", help="torch device (default cuda)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"],
                   help="weights and activations (default bf16)")
    p.add_argument("--prefill", default=None, help="prefill lengths (default 8192,32768,65536,128000)")
    p.add_argument("--batches", default=None, help="decode batches (default 1,8,32,64,128,256)")
    p.add_argument("--contexts", default=None, help="decode contexts (default 8192,32768)")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps per point (default 16)")
    p.add_argument("--warmup", type=int, default=2, help="untimed decode steps per point (default 2)")
    p.add_argument("--reps", type=int, default=3, help="prefill runs at <= 8192 tokens (default 3)")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="hard overall time budget in seconds, model building included (default 540)")
    p.add_argument("--point-cap-s", type=float, default=120.0,
                   help="time cap of one point (default 120)")
    p.add_argument("--attn", default="default",
                   help="attn_implementation (default: transformers' choice; e.g. eager, sdpa, "
                        "flex_attention); falls back to transformers' choice when refused")
    p.add_argument("--experts", default="default",
                   help="experts implementation of transformers 5 (default: its choice; e.g. eager, "
                        "grouped_mm, batched_mm)")
    p.add_argument("--prefill-chunk", type=int, default=0,
                   help="tokens per prefill forward (default 0: from free memory)")
    p.add_argument("--layers", type=int, default=0,
                   help="build only this many layers (labelled in every line; no twain ratio)")
    p.add_argument("--seed", type=int, default=7, help="seed of the random weights and tokens")
    p.add_argument("--router-bias-std", type=float, default=0.1,
                   help="std of the random router biases (default 0.1: near-uniform routing)")
    p.add_argument("--mem-frac", type=float, default=0.92,
                   help="share of the device memory a point may plan to use (default 0.92)")
    p.add_argument("--twain", action="append", default=[], metavar="FILE",
                   help="twain-bench-cuda log or JSON with twain's numbers (repeatable)")
    p.add_argument("--json", default=None,
                   help="write the results here (default $OUT/bench_hf.json when OUT is set)")
    p.add_argument("--selftest", action="store_true",
                   help="run planner, table, JSON and --twain parsing on a fake model (no torch)")
    a = p.parse_args(argv)
    if a.tiny:
        a.prefill = a.prefill or "256,1024,4096"
        a.batches = a.batches or "1,4,16"
        a.contexts = a.contexts or "256,1024"
        a.steps = a.steps or 4
    a.prefill = int_list(a.prefill if a.prefill is not None else "8192,32768,65536,128000")
    a.batches = int_list(a.batches if a.batches is not None else "1,8,32,64,128,256")
    a.contexts = int_list(a.contexts if a.contexts is not None else "8192,32768")
    a.steps = max(1, a.steps or 16)
    a.reps = max(1, a.reps)
    if a.json is None and os.environ.get("OUT"):
        a.json = os.path.join(os.environ["OUT"], "bench_hf.json")
    return a


# ------------------------------------------------------------ twain's numbers
RX_PRE = re.compile(r"^\[(?P<m>[^\]]+)\] prefill\s+(?P<n>\d+) tokens: (?P<t>[0-9.]+) s")
RX_DEC = re.compile(r"^\[(?P<m>[^\]]+)\] decode batch\s+(?P<b>\d+) ctx\s+(?P<c>\d+): (?P<ms>[0-9.]+) ms/step")


def load_twain(paths):
    """{(model, kind, a, b): seconds} from twain-bench-cuda logs or JSON files
    ({"points": [{model, kind, a, b, seconds}]}); the first value of a point wins
    (later A/B runs in the same log are variants)."""
    out = {}
    for path in paths:
        with open(path, errors="replace") as f:
            text = f.read()
        if text.lstrip().startswith("{"):
            for p in json.loads(text).get("points", []):
                if p.get("seconds") is not None and not p.get("skipped"):
                    out.setdefault((p["model"], p["kind"], int(p["a"]), int(p["b"])), float(p["seconds"]))
            continue
        for line in text.splitlines():
            m = RX_PRE.match(line)
            if m:
                out.setdefault((m["m"], "prefill", int(m["n"]), 0), float(m["t"]))
                continue
            m = RX_DEC.match(line)
            if m:
                out.setdefault((m["m"], "decode", int(m["b"]), int(m["c"])), float(m["ms"]) * 1e-3)
    return out


def twain_for(twain, pt, n_models):
    if pt["model"].endswith(" layers)"):  # --layers: not the shapes twain ran
        return None
    t = twain.get((pt["model"], pt["kind"], pt["a"], pt["b"]))
    if t is None and n_models == 1:  # twain-bench-cuda --model DIR names its model 'checkpoint'
        t = twain.get(("checkpoint", pt["kind"], pt["a"], pt["b"]))
    return t


# --------------------------------------------------------------------- runner
class Cut(Exception):
    """A point stopped at its time cap: done units of work in seconds."""

    def __init__(self, done, seconds):
        super().__init__("cut after %s in %.1f s" % (done, seconds))
        self.done, self.seconds = done, seconds


def new_point(model, kind, a, b):
    return {"model": model, "kind": kind, "a": a, "b": b, "seconds": None, "n": 0, "note": "",
            "skipped": None, "lower_bound": False}


def plan(a):
    """The points in run order: the prefills the decode contexts reuse, the
    decode points (context, then batch, ascending), then the other prefills."""
    need = set(a.contexts)
    first = [("prefill", t, 0) for t in a.prefill if t in need]
    dec = [("decode", b, c) for c in sorted(a.contexts) for b in sorted(a.batches)]
    last = [("prefill", t, 0) for t in a.prefill if t not in need]
    return first + dec + last


def run_model(eng, a, deadline, points):
    """Runs every planned point of one engine within the deadline, appending to points."""
    order = plan(a)
    last_use = {c: i for i, (k, _, c) in enumerate(order) if k == "decode"}
    caches, bad_ctx = {}, {}
    warmed = False
    for i, (kind, x, ctx) in enumerate(order):
        pt = new_point(eng.name, kind, x, ctx)
        points.append(pt)
        left = deadline - time.time()
        what = ("prefill %6d tokens" % x) if kind == "prefill" else ("decode batch %3d ctx %6d" % (x, ctx))
        if left < 5:
            pt["skipped"] = "over the overall budget (%.0f s left)" % left
        elif (x if kind == "prefill" else ctx) > eng.max_pos:
            pt["skipped"] = "longer than max_position_embeddings %d" % eng.max_pos
        elif kind == "decode" and ctx in bad_ctx:
            pt["skipped"] = bad_ctx[ctx]
        cap = min(deadline, time.time() + a.point_cap_s)
        try:
            if not pt["skipped"] and not warmed:
                eng.warmup(min(x if kind == "prefill" else ctx, 1024), cap)
                warmed = True
            if pt["skipped"]:
                pass
            elif kind == "prefill":
                pt["skipped"] = eng.prefill_fits(x)
                n = a.reps if x <= 8192 else 1
                ts = []
                for r in range(0 if pt["skipped"] else n):
                    try:
                        t, cache = eng.prefill(x, cap)
                    except Cut:
                        if not ts:
                            raise
                        break  # the runs done so far give the point
                    ts.append(t)
                    if x in last_use and (r == n - 1 or time.time() > cap):
                        caches[x] = cache
                    else:
                        eng.drop(cache)
                    if time.time() > cap:
                        break
                if ts:
                    pt["seconds"], pt["n"], pt["note"] = statistics.median(ts), len(ts), eng.last_note
                    if len(ts) < n:
                        pt["note"] += ", %d of %d runs within the point cap" % (len(ts), n)
            else:
                if ctx not in caches:
                    say("[%s] building a context of %d tokens for decode (untimed)" % (eng.name, ctx))
                    try:
                        caches[ctx] = eng.prefill(ctx, cap)[1]
                    except Exception as ex:  # noqa: BLE001
                        bad_ctx[ctx] = "no context of %d tokens: %s: %s" % (ctx, type(ex).__name__, ex)
                        raise
                pt["skipped"] = eng.decode_fits(caches[ctx], x, ctx, a.warmup + a.steps)
                if not pt["skipped"]:
                    ts = eng.decode(caches[ctx], x, ctx, a.warmup, a.steps, cap)
                    if len(ts) < min(3, a.steps):
                        pt["skipped"] = "over the point cap after %d timed steps" % len(ts)
                    else:
                        pt["seconds"], pt["n"] = statistics.median(ts), len(ts)
                        if len(ts) < a.steps:
                            pt["note"] = "cut at the point cap after %d of %d steps" % (len(ts), a.steps)
        except Cut as c:
            if kind == "prefill":
                pt["skipped"] = "over the point cap: %s of %d tokens in %.1f s" % (c.done, x, c.seconds)
                pt["seconds"], pt["lower_bound"] = c.seconds, True
                if x in last_use:
                    bad_ctx[x] = "no context: its prefill did not finish within the point cap"
            else:
                pt["skipped"] = "over the point cap while %s" % c
        except Exception as ex:  # noqa: BLE001 (out of memory, a transformers change: report, go on)
            msg = str(ex).splitlines()[0][:200] if str(ex) else ""
            pt["skipped"] = "%s: %s" % (type(ex).__name__, msg)
            if not eng.is_oom(ex) and not isinstance(ex, Cut):
                traceback.print_exc()
            eng.reclaim()
        if pt["skipped"]:
            say("[%s] %s: skipped (%s)" % (eng.name, what, pt["skipped"]))
        elif kind == "prefill":
            note = "; " + pt["note"] if pt["note"] else ""
            say("[%s] prefill %6d tokens: %.3f s (%.0f tok/s, median of %d%s)" % (
                eng.name, x, pt["seconds"], x / pt["seconds"], pt["n"], note))
        else:
            t, note = pt["seconds"], "; " + pt["note"] if pt["note"] else ""
            say("[%s] decode batch %3d ctx %6d: %.3f ms/step, %.1f tok/s/seq, %.0f tok/s/GPU "
                "(median of %d%s)" % (eng.name, x, ctx, t * 1e3, 1.0 / t, x / t, pt["n"], note))
        if kind == "decode" and last_use.get(ctx) == i and ctx in caches:
            eng.drop(caches.pop(ctx))  # the last point of this context
    for c in list(caches):
        eng.drop(caches.pop(c))


def table(points, twain, n_models):
    rows = ["| model | run | tokens / batch | context | HF transformers | twain | HF / twain |",
            "|---|---|---|---|---|---|---|"]
    for p in points:
        tw = twain_for(twain, p, n_models) if twain else None
        skip = "skipped: %s" % (p["skipped"] or "")[:80].replace("|", "/")
        if p["kind"] == "prefill":
            hf = ("> %.3f s (cut)" % p["seconds"]) if p["lower_bound"] else (
                "%.3f s (%.0f tok/s)" % (p["seconds"], p["a"] / p["seconds"]) if p["seconds"] else skip)
            tws = "%.3f s" % tw if tw else "-"
        else:
            hf = "%.2f ms/step (%.1f tok/s/seq, %.0f tok/s/GPU)" % (
                p["seconds"] * 1e3, 1 / p["seconds"], p["a"] / p["seconds"]) if p["seconds"] else skip
            tws = "%.2f ms/step" % (tw * 1e3) if tw else "-"
        ratio = "-"
        if tw and p["seconds"]:
            r = p["seconds"] / tw
            ratio = ("> " if p["lower_bound"] else "") + ("%.2fx" % r if r < 10 else "%.1fx" % r)
            p["twain_seconds"], p["hf_over_twain"] = tw, p["seconds"] / tw
        rows.append("| %s | %s | %d | %s | %s | %s | %s |" % (
            p["model"], p["kind"], p["a"], p["b"] or "-", hf, tws, ratio))
    return "\n".join(rows)


# ---------------------------------------------------------- transformers side
class HFEngine:
    """GptOssForCausalLM with random weights; prefill/decode timing helpers."""

    def __init__(self, a, name, cfg, torch, transformers):
        self.a, self.name, self.torch, self.tf = a, name, torch, transformers
        self.dev = torch.device(a.device)
        self.dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
        self.max_pos = int(cfg.get("max_position_embeddings", 131072))
        self.last_note = ""
        self.gen = torch.Generator(device="cpu").manual_seed(a.seed)
        H, I, E = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"]
        L, V, hd = cfg["num_hidden_layers"], cfg["vocab_size"], cfg["head_dim"]
        nh, kvh = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.heads, self.kv_heads, self.head_dim = nh, kvh, hd
        self.full_layers = sum(1 for t in cfg["layer_types"][:L] if t == "full_attention")
        per_layer = (H * nh * hd + nh * hd + 2 * (H * kvh * hd + kvh * hd) + nh * hd * H + H + nh +
                     E * H + E + E * (H * 2 * I + 2 * I + I * H + H) + 2 * H)
        self.params = 2 * V * H + H + L * per_layer
        esize = 2 if self.dtype == torch.bfloat16 else 4
        self.weight_bytes = self.params * esize
        self.info = {"layers": L, "experts": E, "params": self.params, "weight_bytes": self.weight_bytes}
        self.model = None
        if self.dev.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.dev)
            if self.weight_bytes > a.mem_frac * total:
                kern = "installed" if _has_module("kernels") else "not installed"
                raise MemoryError("%s weights need %.1f GB, the GPU has %.1f GB (transformers' MXFP4 "
                                  "compute path needs the 'kernels' hub package: %s here; --layers "
                                  "cuts the model)" % (a.dtype, self.weight_bytes / 1e9, total / 1e9, kern))
        t0 = time.time()
        config = mr.hf_config(cfg, transformers)
        if a.attn != "default":
            try:
                config._attn_implementation = a.attn
            except Exception as ex:  # noqa: BLE001
                say("attn_implementation %r refused (%s): transformers' choice" % (a.attn, ex))
        if a.experts != "default":
            try:
                config._experts_implementation = a.experts
            except Exception as ex:  # noqa: BLE001
                say("experts implementation %r refused (%s): transformers' choice" % (a.experts, ex))
        prev = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with (self.dev if hasattr(self.dev, "__enter__") else contextlib.nullcontext()):  # torch < 2
                self.model = transformers.GptOssForCausalLM(config)
        finally:
            torch.set_default_dtype(prev)
        self.model.eval()
        orient = mr.expert_orientation(self.model, torch)
        mr.randomize_(self.model, a.seed, torch, orient, a.router_bias_std)
        self.sync()
        self.attn_impl = str(getattr(self.model.config, "_attn_implementation", None))
        self.experts_impl = str(getattr(self.model.config, "_experts_implementation", "n/a (transformers 4)"))
        self.info.update(build_s=round(time.time() - t0, 1), attn_implementation=self.attn_impl,
                         experts_implementation=self.experts_impl, experts_orientation=orient)
        say("[%s] built in %.1f s: %d layers, %d experts, %.2f B params, %.1f GB %s weights on %s; "
            "attention %s, experts %s" % (name, time.time() - t0, L, E, self.params / 1e9,
                                          self.weight_bytes / 1e9, a.dtype, self.dev, self.attn_impl,
                                          self.experts_impl))

    # -- helpers
    def sync(self):
        if self.dev.type == "cuda":
            self.torch.cuda.synchronize(self.dev)

    def is_oom(self, ex):
        return isinstance(ex, getattr(self.torch.cuda, "OutOfMemoryError", MemoryError)) or \
            "out of memory" in str(ex)

    def reclaim(self):
        gc.collect()
        if self.dev.type == "cuda":
            self.torch.cuda.empty_cache()

    def drop(self, cache):
        del cache
        self.reclaim()

    def free_bytes(self):
        if self.dev.type != "cuda":
            return 1 << 62
        self.reclaim()
        free, total = self.torch.cuda.mem_get_info(self.dev)
        limit = self.a.mem_frac * total - (total - free)
        return max(0, limit)

    def tokens(self, shape):
        hi = min(self.model.config.vocab_size, 200000)
        return self.torch.randint(0, hi, shape, generator=self.gen).to(self.dev)

    def new_cache(self):
        from transformers import DynamicCache
        try:
            return DynamicCache(config=self.model.config)
        except TypeError:
            return DynamicCache()

    def forward(self, ids, cache, start):
        torch = self.torch
        n = ids.shape[1]
        cp = torch.arange(start, start + n, device=self.dev)
        return self.model(input_ids=ids, past_key_values=cache, use_cache=True, cache_position=cp,
                          position_ids=cp.unsqueeze(0).expand(ids.shape[0], -1), logits_to_keep=1)

    def kv_bytes(self, tokens, batch=1):
        """bf16/fp32 K+V of the full-attention layers (the sliding ones keep a window)."""
        esize = 2 if self.dtype == self.torch.bfloat16 else 4
        return self.full_layers * tokens * batch * self.kv_heads * self.head_dim * 2 * esize

    def chunk_for(self, T):
        if self.a.prefill_chunk > 0:
            return min(T, self.a.prefill_chunk)
        if self.attn_impl != "eager":
            return min(T, 8192)
        # eager: ~6 live copies of the [heads, chunk, T] scores (2 bytes each), MoE activations
        avail = 0.7 * (self.free_bytes() - self.kv_bytes(T))
        c = int(avail // (self.heads * T * 12 + 4 * 23040 * 2))
        return max(256, min(T, 8192, c // 256 * 256))

    def prefill_fits(self, T):
        need = self.kv_bytes(T)
        if need > self.free_bytes():
            return "KV cache %.1f GB > %.1f GB free" % (need / 1e9, self.free_bytes() / 1e9)
        return None

    def cache_bytes(self, cache):
        """Bytes of every tensor reachable from a cache object (its layers' keys/values)."""
        seen, todo, total = set(), [(cache, 0)], 0
        while todo:
            o, depth = todo.pop()
            if id(o) in seen or depth > 4:
                continue
            seen.add(id(o))
            if self.torch.is_tensor(o):
                total += o.numel() * o.element_size()
            elif isinstance(o, (list, tuple)):
                todo.extend((x, depth + 1) for x in o)
            elif isinstance(o, dict):
                todo.extend((x, depth + 1) for x in o.values())
            elif hasattr(o, "__dict__"):
                todo.extend((x, depth + 1) for x in vars(o).values())
        return total

    def decode_fits(self, cache, B, ctx, steps):
        esize = 2 if self.dtype == self.torch.bfloat16 else 4
        # the batch-1 context cache as measured, times B, grown by the steps; one
        # layer's worth more while the cache concatenates the new token
        kv = self.cache_bytes(cache) * B * (ctx + steps + 1) / ctx
        kv += kv / max(1, self.full_layers)
        hd = self.heads * self.head_dim
        # eager repeats K and V to every head for the attention of one layer at a time
        trans = B * (ctx + steps) * esize * ((2 * hd if self.attn_impl == "eager" else 0) +
                                            6 * self.heads + 2 * self.kv_heads * self.head_dim)
        free = self.free_bytes()
        if kv + trans > free:
            return "KV cache %.1f GB + attention temporaries %.1f GB > %.1f GB free" % (
                kv / 1e9, trans / 1e9, free / 1e9)
        return None

    # -- measurements
    def run_prefill(self, T, chunk, cap):
        ids = self.tokens((1, T))
        cache = self.new_cache()
        self.sync()
        t0 = time.perf_counter()
        out = None
        for s in range(0, T, chunk):
            out = self.forward(ids[:, s:s + chunk], cache, s)
            cache = getattr(out, "past_key_values", None) or cache
            if s + chunk < T:
                self.sync()  # so that the cap below sees the device's progress
            if time.time() > cap and s + chunk < T:
                dt = time.perf_counter() - t0
                del out, cache
                self.reclaim()
                raise Cut("%d" % (s + chunk), dt)
        out.logits[:, -1].argmax(-1).tolist()  # the next token on the host, as an engine returns it
        self.sync()
        return time.perf_counter() - t0, cache

    def prefill(self, T, cap):
        chunk = self.chunk_for(T)
        for attempt in range(4):
            try:
                t, cache = self.run_prefill(T, chunk, cap)
                self.last_note = "one pass" if chunk >= T else "chunks of %d" % chunk
                return t, cache
            except Exception as ex:  # noqa: BLE001
                if not self.is_oom(ex) or chunk <= 256 or attempt == 3:
                    raise
                self.reclaim()
                say("[%s] prefill %d: out of memory with chunks of %d, retrying with %d" % (
                    self.name, T, chunk, chunk // 2))
                chunk //= 2
        raise RuntimeError("unreachable")

    def warmup(self, T, cap):
        t, cache = self.prefill(T, cap)
        say("[%s] warm-up prefill of %d tokens: %.2f s (untimed)" % (self.name, T, t))
        self.drop(cache)

    def repeat_cache(self, cache, B):
        """Every sequence gets sequence 0's keys/values: Cache.batch_repeat_interleave,
        else its layers', else each [1, heads, len, dim] tensor of the cache and its
        layers repeated."""
        if hasattr(cache, "batch_repeat_interleave"):
            cache.batch_repeat_interleave(B)
            return
        layers = list(getattr(cache, "layers", []) or [])
        if layers and all(hasattr(lay, "batch_repeat_interleave") for lay in layers):
            for lay in layers:
                lay.batch_repeat_interleave(B)
            return
        n = 0
        for obj in [cache] + layers:
            for k, v in list(vars(obj).items()):
                if self.torch.is_tensor(v) and v.dim() == 4 and v.shape[0] == 1:
                    setattr(obj, k, v.repeat_interleave(B, 0))
                    n += 1
                elif isinstance(v, list) and v and all(self.torch.is_tensor(x) for x in v):
                    v[:] = [x.repeat_interleave(B, 0) if x.dim() == 4 and x.shape[0] == 1 else x
                            for x in v]
                    n += len(v)
        if not n:
            raise RuntimeError("cannot replicate this transformers' cache (%s) over a batch" %
                               type(cache).__name__)

    def decode(self, base, B, ctx, warmup, steps, cap):
        cache = copy.deepcopy(base)
        if B > 1:
            self.repeat_cache(cache, B)
        tok = self.tokens((B, 1))
        ts = []
        try:
            for i in range(warmup + steps):
                self.sync()
                t0 = time.perf_counter()
                out = self.forward(tok, cache, ctx + i)
                cache = getattr(out, "past_key_values", None) or cache
                tok = out.logits[:, -1:].argmax(-1)
                self.sync()
                if i >= warmup:
                    ts.append(time.perf_counter() - t0)
                del out
                if time.time() > cap:
                    break
        finally:
            del cache
            self.reclaim()
        return ts


def _has_module(name):
    import importlib.util
    return importlib.util.find_spec(name) is not None


# ------------------------------------------------------------------ selftest
class FakeEngine:
    """Deterministic stand-in for HFEngine (no torch): prefill T tokens costs
    T/1e6 s, a decode step 1 ms + B * ctx * 1e-9 s; batch 256 does not fit."""

    def __init__(self, name, max_pos):
        self.name, self.max_pos, self.last_note = name, max_pos, "fake"
        self.info = {"layers": 0, "experts": 0}
        self.attn_impl = self.experts_impl = "fake"

    def warmup(self, T, cap):
        pass

    def prefill_fits(self, T):
        return None

    def prefill(self, T, cap):
        if T > 100000:
            raise Cut("65536", 42.0)
        return T / 1e6, {"ctx": T}

    def decode_fits(self, cache, B, ctx, steps):
        return "KV cache does not fit (fake)" if B >= 256 else None

    def decode(self, base, B, ctx, warmup, steps, cap):
        assert base["ctx"] == ctx
        return [1e-3 + B * ctx * 1e-9] * steps

    def drop(self, cache):
        pass

    def reclaim(self):
        pass

    def is_oom(self, ex):
        return False


SELFTEST_LOG = """[bench] programmatic dependent launch on (TWAIN_CUDA_PDL=unset)
[gpt-oss-20b] engine ready in 4.2 s
[gpt-oss-20b] prefill   8192 tokens: 0.130 s (63015 tok/s, median of 3)
[gpt-oss-20b] prefill  32768 tokens: 0.829 s (39527 tok/s, median of 1)
[gpt-oss-20b] decode batch   1 ctx   8192: 3.193 ms/step, 313.2 tok/s/seq, 313 tok/s/GPU
[gpt-oss-20b] decode batch   8 ctx   8192: 11.682 ms/step, 85.6 tok/s/seq, 685 tok/s/GPU
[gpt-oss-20b] decode batch 256 ctx  32768: skipped (KV needs 526336 blocks, pool 147000)
[gpt-oss-20b] decode batch   1 ctx   8192: 3.281 ms/step, 304.8 tok/s/seq, 305 tok/s/GPU
| gpt-oss-20b | prefill | 8192 | - | 0.130 s | 63015 tok/s | 0.0133 | 0.55x (0.239 s) |
"""


def selftest(a):
    """Checks the twain-log parser on bench_cuda's line formats (values from
    docs/benchmarks.md) and the planner/table/JSON path on FakeEngine."""
    import tempfile
    fails = []
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "bench_20b.log")
        with open(path, "w") as f:
            f.write(SELFTEST_LOG)
        tw = load_twain([path])
        want = {("gpt-oss-20b", "prefill", 8192, 0): 0.130, ("gpt-oss-20b", "prefill", 32768, 0): 0.829,
                ("gpt-oss-20b", "decode", 1, 8192): 3.193e-3, ("gpt-oss-20b", "decode", 8, 8192): 11.682e-3}
        if set(tw) != set(want) or any(abs(tw[k] - v) > 1e-12 for k, v in want.items()):
            fails.append("twain log parse: got %s" % tw)
        a.prefill, a.batches, a.contexts, a.steps, a.reps = [8192, 32768, 128000], [1, 8, 256], [8192], 4, 3
        a.point_cap_s = 60
        order = [(k, x, c) for k, x, c in plan(a)]
        if order != [("prefill", 8192, 0), ("decode", 1, 8192), ("decode", 8, 8192), ("decode", 256, 8192),
                     ("prefill", 32768, 0), ("prefill", 128000, 0)]:
            fails.append("plan order: %s" % order)
        points = []
        run_model(FakeEngine("gpt-oss-20b", 131072), a, time.time() + 60, points)
        got = {(p["kind"], p["a"], p["b"]): p for p in points}
        if abs(got[("decode", 8, 8192)]["seconds"] - (1e-3 + 8 * 8192e-9)) > 1e-12 or \
                got[("decode", 256, 8192)]["skipped"] != "KV cache does not fit (fake)" or \
                not got[("prefill", 128000, 0)]["lower_bound"] or got[("prefill", 8192, 0)]["n"] != 3:
            fails.append("run_model points: %s" % points)
        tab = table(points, tw, 1)
        want_rows = ["| gpt-oss-20b | decode | 1 | 8192 | 1.01 ms/step (991.9 tok/s/seq, 992 tok/s/GPU) | "
                     "3.19 ms/step | 0.32x |",
                     "| gpt-oss-20b | prefill | 128000 | - | > 42.000 s (cut) | - | - |"]
        if any(r not in tab for r in want_rows):
            fails.append("table:\n" + tab)
        jpath = os.path.join(d, "hf.json")
        write_json(jpath, a, points, {"gpt-oss-20b": {}}, {"selftest": True})
        if load_twain([jpath]) != {("gpt-oss-20b", "prefill", 8192, 0): 0.008192,
                                   ("gpt-oss-20b", "prefill", 32768, 0): 0.032768,
                                   ("gpt-oss-20b", "decode", 1, 8192): 1e-3 + 8192e-9,
                                   ("gpt-oss-20b", "decode", 8, 8192): 1e-3 + 8 * 8192e-9}:
            fails.append("JSON round trip: %s" % load_twain([jpath]))
        print(tab)
    for f in fails:
        print("FAIL " + f)
    print("bench_hf selftest: %s" % ("PASS" if not fails else "%d failure(s)" % len(fails)))
    return 1 if fails else 0


def write_json(path, a, points, models, env):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    keys = ("device", "dtype", "prefill", "batches", "contexts", "steps", "warmup", "reps", "budget_s",
            "point_cap_s", "attn", "experts", "prefill_chunk", "layers", "seed", "router_bias_std",
            "mem_frac", "tiny")
    doc = dict(env, tool="tests/bench/bench_hf.py",
               started_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(T0)),
               settings={k: getattr(a, k) for k in keys},
               models=models, points=points,
               point_keys="prefill: a = tokens, b = 0, seconds = latency; decode: a = batch, b = context, "
                          "seconds = one step (median); lower_bound: cut at the point cap after that time")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    say("wrote %s" % path)


def main(argv):
    a = parse_args(argv)
    if a.selftest:
        return selftest(a)
    deadline = T0 + a.budget_s
    twain = load_twain(a.twain)
    if a.twain:
        say("twain's numbers: %d points from %s" % (len(twain), ", ".join(a.twain)))
    try:  # here, so that --help and --selftest work without torch
        import torch
        import transformers
    except ImportError as ex:
        say("cannot import torch/transformers (%s): nothing to measure here" % ex)
        return 77
    env = {"transformers": transformers.__version__, "torch": torch.__version__,
           "kernels_package": _has_module("kernels"), "timing": "device synchronize + host clock per call"}
    if a.device.startswith("cuda"):
        if not torch.cuda.is_available():
            say("no CUDA device: nothing to measure (use --device cpu --tiny for a smoke test)")
            return 77
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpu_memory_gb"] = round(torch.cuda.mem_get_info()[1] / 1e9, 1)
    say("transformers %s, torch %s, device %s%s, %s weights and activations, random weights (seed %d)" % (
        transformers.__version__, torch.__version__, a.device, " (%s)" % env.get("gpu", ""), a.dtype, a.seed))
    if a.tiny:
        cfgs = [("tiny-gptoss-wordnet", mr.load_config_dict("tiny"))]
    else:
        names = ["20b", "120b"] if a.model == "both" else [a.model]
        cfgs = [("gpt-oss-" + m, mr.load_config_dict(m)) for m in names]
    points, models = [], {}
    with torch.inference_mode():
        for name, cfg in cfgs:
            cfg = dict(cfg)
            if a.layers:
                cfg["num_hidden_layers"] = a.layers
                cfg["layer_types"] = cfg["layer_types"][:a.layers]
                name = "%s (%d layers)" % (name, a.layers)
            if deadline - time.time() < 10:
                models[name] = {"skipped": "over the overall budget"}
                say("[%s] skipped: over the overall budget" % name)
                continue
            eng = None
            try:
                eng = HFEngine(a, name, cfg, torch, transformers)
                models[name] = eng.info
                run_model(eng, a, deadline, points)
            except Exception as ex:  # noqa: BLE001
                models[name] = {"skipped": "%s: %s" % (type(ex).__name__, ex)}
                say("[%s] skipped: %s: %s" % (name, type(ex).__name__, ex))
                if not isinstance(ex, MemoryError):
                    traceback.print_exc()
            finally:
                if eng is not None:
                    eng.model = None
                del eng
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
    env["attn_implementation"] = ", ".join(sorted({str(m.get("attn_implementation")) for m in models.values()
                                                   if "attn_implementation" in m})) or "-"
    print()
    print("== Hugging Face transformers %s, %s, %s (attention %s), %.0f s ==" % (
        transformers.__version__, env.get("gpu", a.device), a.dtype, env["attn_implementation"],
        time.time() - T0))
    print(table(points, twain, len(cfgs)), flush=True)
    for name, m in models.items():
        if m.get("skipped"):
            print("%s: not measured: %s" % (name, m["skipped"]), flush=True)
    if a.json:
        write_json(a.json, a, points, models, env)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
