#!/usr/bin/env python3
"""bench_reference.py: single-thread encode MB/s of Hugging Face tokenizers and
tiktoken on the tokenizer corpus, the comparison points of twain-bench-tokenizer
(docs/benchmarks.md "Tokenizer"). For a machine with both Python packages (the
GPU machine); run twain-bench-tokenizer on the same machine for the ratio.

    python3 tests/tokenizer/bench_reference.py DATA_DIR [REPEATS]

DATA_DIR is build/tests/tokenizer/data after `ctest -R tokenizer.setup` (it has
corpus.bin, corpus.idx, tokenizer.json and the reference ids). tiktoken gets the
ranks of tokenizer.json (vocab id = rank, spec §5.1) and its pre-tokenizer regex
(spec §5.2); both libraries' ids are checked against the reference ids too.
Threads: RAYON_NUM_THREADS=1 and one encode call at a time.
"""
import json
import os
import struct
import sys
import time

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def byte_decoder():
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    inv, n = {}, 0
    for b in range(256):
        if b in bs:
            inv[chr(b)] = b
        else:
            inv[chr(256 + n)] = b
            n += 1
    return inv


def read_ref(path):
    if not os.path.exists(path):
        return None
    data = open(path, "rb").read()
    out, o = [], 0
    while o < len(data):
        (n,) = struct.unpack_from("<I", data, o)
        out.append(list(struct.unpack_from("<%dI" % n, data, o + 4)))
        o += 4 + 4 * n
    return out


def timed(name, fn, docs, kinds, sizes, repeats, ref):
    best, best_cpu, ids = 1e30, 1e30, None
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        ids = [fn(d) for d in docs]
        best = min(best, time.perf_counter() - t0)
        best_cpu = min(best_cpu, time.process_time() - c0)
    total = sum(sizes)
    diff = sum(1 for a, b in zip(ids, ref) if list(a) != b) if ref else -1
    print("%s: %.2f MB/s wall, %.2f MB/s cpu, single thread (best of %d: %.3f s)%s" % (
        name, total / best / 1e6, total / best_cpu / 1e6, repeats, best,
        "; documents differing from the reference ids: %d" % diff if diff >= 0 else ""))
    per = {}
    for d, k, n in zip(docs, kinds, sizes):
        t0 = time.process_time()
        fn(d)
        b, s = per.get(k, (0, 0.0))
        per[k] = (b + n, s + time.process_time() - t0)
    for k, (b, s) in per.items():
        print("  %-12s %9d bytes %8.2f MB/s cpu" % (k, b, b / max(s, 1e-9) / 1e6))


def main():
    data = sys.argv[1]
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    corpus = open(os.path.join(data, "corpus.bin"), "rb").read()
    idx = [l.split() for l in open(os.path.join(data, "corpus.idx")).read().split("\n") if l]
    docs = [corpus[int(o):int(o) + int(n)].decode("utf-8") for o, n, _ in idx]
    kinds = [k for _, _, k in idx]
    sizes = [int(n) for _, n, _ in idx]
    tok_path = os.path.join(data, "tokenizer.json")
    print("corpus: %d documents, %d bytes" % (len(docs), len(corpus)))

    import tokenizers
    hf = tokenizers.Tokenizer.from_file(tok_path)
    timed("hf tokenizers %s encode" % tokenizers.__version__,
          lambda d: hf.encode(d, add_special_tokens=False).ids, docs, kinds, sizes, repeats,
          read_ref(os.path.join(data, "real.special.ids")))

    import tiktoken
    j = json.load(open(tok_path))
    inv = byte_decoder()
    ranks = {bytes(inv[c] for c in k): v for k, v in j["model"]["vocab"].items()}
    split = [p for p in j["pre_tokenizer"]["pretokenizers"] if p["type"] == "Split"][0]
    enc = tiktoken.Encoding("gpt-oss-from-tokenizer-json", pat_str=split["pattern"]["Regex"],
                            mergeable_ranks=ranks, special_tokens={})
    timed("tiktoken %s encode_ordinary" % tiktoken.__version__, enc.encode_ordinary, docs, kinds,
          sizes, repeats, read_ref(os.path.join(data, "real.ordinary.ids")))


if __name__ == "__main__":
    main()
