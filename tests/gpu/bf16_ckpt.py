#!/usr/bin/env python3
"""bf16_ckpt.py: carry the bf16 tiny checkpoint to the GPU machine cheaply.

The bf16 model (shared/models/tiny-gptoss-wordnet, 35 MB) and the MXFP4 one
tracked in tests/fixtures/tiny-gptoss-wordnet-mxfp4 share every tensor but
the experts. So only the bf16 expert tensors travel:

  split BF16_DIR MXFP4_DIR OUT_FILE
      writes the bf16 expert tensors (*.mlp.experts.gate_up_proj / down_proj)
      of BF16_DIR/model.safetensors into OUT_FILE (safetensors), after checking
      that every other bf16 tensor equals the MXFP4 checkpoint's byte for byte
  join MXFP4_DIR EXPERTS_FILE OUT_DIR
      writes OUT_DIR/model.safetensors = the MXFP4 checkpoint's tensors minus
      its *_blocks/*_scales plus the carried bf16 experts, and OUT_DIR/config.json
      without quantization_config

No torch needed (plain safetensors parsing). Exit status 1 on any mismatch.
"""
import json
import os
import struct
import sys


def read_st(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        hdr = json.loads(f.read(n))
        data = f.read()
    meta = hdr.pop("__metadata__", None)
    out = {}
    for k, v in hdr.items():
        a, b = v["data_offsets"]
        out[k] = (v["dtype"], v["shape"], data[a:b])
    return out, meta


def write_st(path, tensors):
    hdr, off, blobs = {}, 0, []
    for k in sorted(tensors):
        dt, shape, raw = tensors[k]
        hdr[k] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + len(raw)]}
        off += len(raw)
        blobs.append(raw)
    hdr["__metadata__"] = {"format": "pt"}
    h = json.dumps(hdr, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def is_expert(k):
    return k.endswith("mlp.experts.gate_up_proj") or k.endswith("mlp.experts.down_proj")


def split(bf16_dir, mx_dir, out_file):
    bf, _ = read_st(os.path.join(bf16_dir, "model.safetensors"))
    mx, _ = read_st(os.path.join(mx_dir, "model.safetensors"))
    bad = 0
    for k, v in bf.items():
        if is_expert(k):
            continue
        if k not in mx or mx[k] != v:
            print(f"bf16_ckpt split: tensor {k} differs between the two checkpoints", file=sys.stderr)
            bad += 1
    if bad:
        return 1
    write_st(out_file, {k: v for k, v in bf.items() if is_expert(k)})
    return 0


def join(mx_dir, experts_file, out_dir):
    mx, _ = read_st(os.path.join(mx_dir, "model.safetensors"))
    ex, _ = read_st(experts_file)
    t = {k: v for k, v in mx.items()
         if not (k.endswith("_proj_blocks") or k.endswith("_proj_scales"))}
    t.update(ex)
    os.makedirs(out_dir, exist_ok=True)
    write_st(os.path.join(out_dir, "model.safetensors"), t)
    with open(os.path.join(mx_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config", None)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return 0


def main(argv):
    if len(argv) == 4 and argv[0] == "split":
        return split(*argv[1:])
    if len(argv) == 4 and argv[0] == "join":
        return join(*argv[1:])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
