#!/usr/bin/env python3
"""make_reference.py: regenerate Hugging Face reference fixtures for twain.

Runs transformers' GptOssForCausalLM in float32 with eager attention on given
prompt token ids and writes, into --out:

  <variant>_<prompt>_logits.f32.bin   little-endian float32 [rows, vocab]
  manifest.json                       same format as
                                      tests/fixtures/tiny-gptoss-wordnet/manifest.json
                                      (argmax and logsumexp at every position,
                                      greedy continuation, its smallest top-1/top-2
                                      margin, and whether generate() with a KV cache
                                      agrees); entries of other variants/prompts
                                      already in the file are kept
  prompts.json                        the prompt ids, if not already there

The model is either an existing checkpoint (--checkpoint DIR, bf16 or MXFP4
experts; MXFP4 is dequantised by transformers with Mxfp4Config(dequantize=True))
or a random one (--config tiny|20b-4layer|FILE.json --random-weights --seed N
--write-checkpoint DIR [--mxfp4]), written in the Hugging Face layout first:
bf16 tensors via save_pretrained, and with --mxfp4 the expert matrices encoded
as in shared/models/tiny-gptoss-wordnet-mxfp4/README.md (transposed to
[E, out, in], blocks of 32 along the input dimension, low nibble = even element,
E8M0 scale chosen per block as the smallest power of two with max|w|/scale <= 6
or half of it, whichever gives the smaller squared error).

Needs torch, transformers >= 5 and safetensors (the GPU machine has them).
Everything runs on --device (default cpu) in float32.

Examples:
  python3 make_reference.py --checkpoint ../shared/models/tiny-gptoss-wordnet \\
      --prompts tests/fixtures/tiny-gptoss-wordnet/prompts.json --variant bf16 --out /tmp/fx
  python3 make_reference.py --config 20b-4layer --random-weights --seed 1 --mxfp4 \\
      --write-checkpoint /tmp/rand20b --prompts ids.json --variant mxfp4 --out /tmp/fx20b
"""

import argparse
import json
import math
import os
import sys

TINY_CONFIG = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
    "num_hidden_layers": 4, "num_local_experts": 8, "num_experts_per_tok": 2,
    "experts_per_token": 2, "vocab_size": 8064, "hidden_size": 256, "intermediate_size": 512,
    "head_dim": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": 32,
    "layer_types": ["sliding_attention", "full_attention"] * 2, "attention_bias": True,
    "attention_dropout": 0.0, "swiglu_limit": 7.0, "rms_norm_eps": 1e-05,
    "rope_theta": 150000.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "original_max_position_embeddings": 4096, "truncate": False},
    "initial_context_length": 4096, "max_position_embeddings": 4096,
    "tie_word_embeddings": False, "eos_token_id": 8004, "pad_token_id": 8001,
}

# gpt-oss-20b (spec 1.1) cut to 4 layers: real shapes, small enough for one GPU.
GPTOSS_20B_4LAYER = dict(TINY_CONFIG, **{
    "num_hidden_layers": 4, "num_local_experts": 32, "num_experts_per_tok": 4,
    "experts_per_token": 4, "vocab_size": 201088, "hidden_size": 2880,
    "intermediate_size": 2880, "num_attention_heads": 64, "num_key_value_heads": 8,
    "sliding_window": 128, "max_position_embeddings": 131072,
    "eos_token_id": 200002, "pad_token_id": 199999,
})

# The full models (spec 1.1): tests/bench/bench_hf.py times these with random weights.
GPTOSS_20B = dict(GPTOSS_20B_4LAYER, num_hidden_layers=24,
                  layer_types=["sliding_attention", "full_attention"] * 12)
GPTOSS_120B = dict(GPTOSS_20B, num_hidden_layers=36, num_local_experts=128,
                   layer_types=["sliding_attention", "full_attention"] * 18)

PRESETS = {"tiny": TINY_CONFIG, "20b-4layer": GPTOSS_20B_4LAYER, "20b": GPTOSS_20B,
           "120b": GPTOSS_120B}

FP4_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
MXFP4_QUANT = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def parse_args(argv):
    p = argparse.ArgumentParser(
        description="Regenerate HF transformers reference logits/manifest for twain.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="existing HF checkpoint directory")
    src.add_argument("--config", help="'tiny', '20b-4layer', '20b', '120b' or a config.json path "
                                      "(with --random-weights)")
    p.add_argument("--random-weights", action="store_true", help="random weights for --config")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    p.add_argument("--mxfp4", action="store_true",
                   help="write the random checkpoint with MXFP4 experts")
    p.add_argument("--write-checkpoint", metavar="DIR",
                   help="where the random checkpoint is written (required with --random-weights)")
    p.add_argument("--prompts", required=True,
                   help="JSON: a list of ids, {name: [ids]} or prompts.json {name: {ids: [...]}}")
    p.add_argument("--out", required=True, help="output directory for logits and manifest.json")
    p.add_argument("--variant", default=None, help="entry variant name (default: mxfp4 or bf16)")
    p.add_argument("--greedy", type=int, default=48, help="greedy tokens after each prompt (48)")
    p.add_argument("--eos-id", type=int, default=None,
                   help="stop the greedy loop after this id (default: config eos_token_id)")
    p.add_argument("--last-rows", type=int, default=0,
                   help="store only the last N rows of logits (0 = all positions)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--router-bias-std", type=float, default=0.1,
                   help="std of the random router biases (default 0.1). Random routers put many "
                        "tokens at near-ties between the k-th and (k+1)-th expert, where bf16 "
                        "rounding of the activations flips the choice; a larger bias spread "
                        "widens the gaps between router logits, as trained routers have")
    p.add_argument("--bf16-sensitivity", action="store_true",
                   help="after the references: run the model again in bfloat16 (weights and "
                        "activations, eager attention) and print per prompt the relative L2 of "
                        "its logits against the float32 ones (all rows, rows 0..7, rows 8..): "
                        "the model's own sensitivity to bf16 arithmetic")
    a = p.parse_args(argv)
    if a.config and not a.random_weights:
        p.error("--config needs --random-weights")
    if a.random_weights and not a.write_checkpoint:
        p.error("--random-weights needs --write-checkpoint DIR")
    if a.checkpoint and (a.random_weights or a.mxfp4):
        p.error("--random-weights/--mxfp4 only apply to --config")
    return a


def load_prompts(path):
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, list):
        data = {"prompt": data}
    prompts = {}
    for name, v in data.items():
        ids = v["ids"] if isinstance(v, dict) else v
        if not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
            raise SystemExit(f"prompt {name}: ids must be a non-empty list of non-negative ints")
        prompts[name] = [int(i) for i in ids]
    return prompts


def load_config_dict(spec):
    if spec in PRESETS:
        return json.loads(json.dumps(PRESETS[spec]))
    with open(spec) as f:
        return json.load(f)


def expert_orientation(model, torch):
    """'in_out' when HF keeps the experts as [E, in, out] (used as x @ W, spec
    §3.5), 'out_in' when [E, out, in]; decided on gate_up's shape ([E, H, 2I]
    or [E, 2I, H]), which differ for every gpt-oss config (2I != H)."""
    H, I = model.config.hidden_size, model.config.intermediate_size
    for name, prm in model.named_parameters():
        if name.endswith("mlp.experts.gate_up_proj"):
            if tuple(prm.shape[1:]) == (H, 2 * I):
                return "in_out"
            if tuple(prm.shape[1:]) == (2 * I, H):
                return "out_in"
            raise SystemExit(f"make_reference: unexpected {name} shape {tuple(prm.shape)}")
    raise SystemExit("make_reference: no mlp.experts.gate_up_proj parameter in the HF model "
                     "(transformers renamed it?): " +
                     ", ".join(n for n, _ in list(model.named_parameters())[:20]))


def randomize_(model, seed, torch, orient, router_bias_std=0.1):
    """Every parameter gets non-trivial values (biases and sinks included, so
    that a kernel ignoring one of them fails): matrices N(0, 1/sqrt(fan_in)),
    vectors N(0, 0.1), norm scales 1 + N(0, 0.1), sinks N(0, 1), embeddings N(0, 1).
    Values are drawn on the parameter's device with a generator seeded `seed`."""
    H = model.config.hidden_size
    gens = {}
    for name, prm in sorted(model.named_parameters()):
        dev = prm.device
        if str(dev) not in gens:
            gens[str(dev)] = torch.Generator(device=dev).manual_seed(seed)
        g = gens[str(dev)]
        shape = tuple(prm.shape)

        def rn():
            return torch.randn(shape, generator=g, device=dev, dtype=torch.float32)
        if "norm" in name:
            val = 1.0 + 0.1 * rn()
        elif name.endswith("sinks"):
            val = rn()
        elif "embed_tokens" in name:
            val = rn()
        elif "router" in name and name.endswith("bias"):
            val = router_bias_std * rn()
        elif name.endswith("bias") or len(shape) == 1:
            val = 0.1 * rn()
        elif "experts" in name:
            fan_in = shape[1] if orient == "in_out" else shape[2]
            val = rn() / math.sqrt(fan_in)
        elif "lm_head" in name or len(shape) == 2:
            val = rn() / math.sqrt(shape[-1] if len(shape) == 2 else H)
        else:
            val = 0.1 * rn()
        with torch.no_grad():
            prm.copy_(val.to(prm.dtype))
        del val


def mxfp4_encode(w, torch):
    """w: [E, out, in] float. Returns (blocks u8 [E, out, in/32, 16], scales u8 [E, out, in/32])."""
    E, R, C = w.shape
    assert C % 32 == 0, "the input dimension must be a multiple of 32"
    b = w.float().reshape(E, R, C // 32, 32)
    grid = torch.tensor(FP4_GRID, dtype=torch.float32, device=w.device)
    amax = b.abs().amax(dim=-1)
    e_hi = torch.ceil(torch.log2(torch.clamp(amax / 6.0, min=2.0 ** -127)))
    best_err, best_idx, best_e, best_v = None, None, None, None
    for e in (e_hi, e_hi - 1):
        e = torch.clamp(e, -127, 127)
        v = b / torch.exp2(e)[..., None]
        idx = torch.argmin((v.abs()[..., None] - grid).abs(), dim=-1)  # ties: lower magnitude
        q = grid[idx] * torch.sign(v) * torch.exp2(e)[..., None]
        err = ((q - b) ** 2).sum(dim=-1)
        del q
        if best_err is None:
            best_err, best_idx, best_e, best_v = err, idx, e, v
        else:
            take = err < best_err
            best_err = torch.where(take, err, best_err)
            best_idx = torch.where(take[..., None], idx, best_idx)
            best_v = torch.where(take[..., None], v, best_v)
            best_e = torch.where(take, e, best_e)
    nib = best_idx.to(torch.uint8) | ((best_v < 0) & (best_idx > 0)).to(torch.uint8) * 8
    blocks = (nib[..., 0::2] | (nib[..., 1::2] << 4)).to(torch.uint8)
    scales = (best_e + 127).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()


def mxfp4_decode(blocks, scales, torch):
    """Inverse of mxfp4_encode (spec §3.4): float32 [E, out, in]."""
    grid = torch.tensor(FP4_GRID, dtype=torch.float32, device=blocks.device)
    lo, hi = blocks & 15, blocks >> 4
    nib = torch.stack([lo, hi], dim=-1).reshape(*blocks.shape[:-1], 32).long()
    val = grid[nib & 7] * torch.where((nib & 8) > 0, -1.0, 1.0)
    val = val * torch.exp2(scales.float() - 127.0)[..., None]
    E, R = blocks.shape[0], blocks.shape[1]
    return val.reshape(E, R, -1)


def hf_config(cfg_dict, transformers):
    """transformers.GptOssConfig for a config.json dict (no quantization_config):
    the legacy rope_scaling spelling, else rope_parameters (transformers >= 5);
    SystemExit when the YaRN rope configuration does not reach the config (spec 2.5)."""
    hf_dict = dict(cfg_dict)
    hf_dict.pop("model_type", None)  # a class attribute of GptOssConfig
    try:
        config = transformers.GptOssConfig(**hf_dict)
    except Exception as ex:  # transformers >= 5 may want rope_parameters
        print(f"GptOssConfig with rope_scaling failed ({ex}); retrying with rope_parameters",
              file=sys.stderr)
        rp = dict(hf_dict.pop("rope_scaling"), rope_theta=hf_dict.pop("rope_theta"))
        config = transformers.GptOssConfig(rope_parameters=rp, **hf_dict)
    rp_eff = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if "yarn" not in str(rp_eff) and "rope_scaling" in hf_dict:
        # this transformers dropped the legacy key: YaRN must reach the model (spec §2.5)
        rp = dict(hf_dict.pop("rope_scaling"), rope_theta=hf_dict.pop("rope_theta"))
        config = transformers.GptOssConfig(rope_parameters=rp, **hf_dict)
        rp_eff = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    print(f"HF rope configuration: {rp_eff}", file=sys.stderr)
    if "yarn" not in str(rp_eff):
        raise SystemExit("make_reference: transformers did not take the YaRN rope configuration")
    return config


def write_random_checkpoint(a, torch, transformers):
    """Build a random GptOssForCausalLM on --device, write it in the HF file
    layout that twain's loader reads (our own safetensors writer and config.json,
    so nothing depends on transformers' save format) and return (dir, model):
    the in-memory float32 model holds exactly the written values (bf16-rounded,
    experts replaced by their dequantised MXFP4 values with --mxfp4)."""
    from safetensors.torch import save_file
    cfg_dict = load_config_dict(a.config)
    cfg_dict.pop("quantization_config", None)
    config = hf_config(cfg_dict, transformers)
    try:
        config._attn_implementation = "eager"
    except Exception:
        pass
    torch.manual_seed(a.seed)
    with torch.device(a.device):
        model = transformers.GptOssForCausalLM(config)
    model = model.to(torch.float32).eval()
    orient = expert_orientation(model, torch)
    randomize_(model, a.seed, torch, orient, a.router_bias_std)
    H, I = config.hidden_size, config.intermediate_size
    out = {}
    with torch.no_grad():
        for name, prm in model.named_parameters():
            prm.copy_(prm.to(torch.bfloat16).float())  # the checkpoint's values
            is_ex = name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj")
            if not is_ex:
                out[name] = prm.detach().to(torch.bfloat16).cpu().contiguous()
                continue
            # file orientation: bf16 [E, in, out] (spec §3.5); MXFP4 [E, out, in]
            w_io = prm if orient == "in_out" else prm.transpose(1, 2)
            if not a.mxfp4:
                out[name] = w_io.detach().to(torch.bfloat16).cpu().contiguous()
                continue
            blocks, scales = mxfp4_encode(w_io.transpose(1, 2).contiguous(), torch)
            deq = mxfp4_decode(blocks, scales, torch)  # [E, out, in]
            prm.copy_(deq.transpose(1, 2) if orient == "in_out" else deq)
            out[name + "_blocks"] = blocks.cpu()
            out[name + "_scales"] = scales.cpu()
            del blocks, scales, deq, w_io
    if orient == "out_in":
        print("note: this transformers keeps experts as [E, out, in]", file=sys.stderr)
    want = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
            "model.layers.0.self_attn.sinks", "model.layers.0.mlp.router.weight",
            "model.layers.0.mlp.experts.gate_up_proj_bias"]
    missing = [n for n in want if n not in out]
    if missing:
        raise SystemExit(f"make_reference: HF parameter names differ from the checkpoint "
                         f"layout, missing {missing}; have e.g. {sorted(out)[:12]}")
    os.makedirs(a.write_checkpoint, exist_ok=True)
    save_file(out, os.path.join(a.write_checkpoint, "model.safetensors"),
              metadata={"format": "pt"})
    c = dict(cfg_dict)
    if a.mxfp4:
        c["quantization_config"] = MXFP4_QUANT
    with open(os.path.join(a.write_checkpoint, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
    del out
    print(f"wrote random checkpoint (seed {a.seed}, {'MXFP4' if a.mxfp4 else 'bf16'} experts, "
          f"HF experts {orient}) to {a.write_checkpoint}", file=sys.stderr)
    return a.write_checkpoint, model


def load_model(ckpt, device, torch, transformers):
    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    is_mxfp4 = (cfg.get("quantization_config") or {}).get("quant_method") == "mxfp4"
    kw = {"attn_implementation": "eager"}
    if is_mxfp4:
        kw["quantization_config"] = transformers.Mxfp4Config(dequantize=True)
    model = transformers.GptOssForCausalLM.from_pretrained(ckpt, **kw)
    model = model.float().to(device).eval()  # checkpoint values upcast to float32
    return model, is_mxfp4, cfg


def greedy(model, ids, n, eos, torch, device):
    """Greedy continuation recomputing the whole sequence each step (no cache)."""
    seq = list(ids)
    out, margin, stopped = [], float("inf"), False
    for _ in range(n):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([seq], device=device)).logits[0, -1].float()
        top = torch.topk(logits, 2)
        margin = min(margin, float(top.values[0] - top.values[1]))
        # lowest id among exact ties, like the engines
        tok = int(torch.nonzero(logits == top.values[0])[0, 0])
        out.append(tok)
        seq.append(tok)
        if eos is not None and tok == eos:
            stopped = True
            break
    return out, margin, stopped


def rel_l2(got, ref):
    """||got - ref|| / ||ref|| over all elements (float64), inf when ref is 0."""
    got, ref = got.double(), ref.double()
    den = float(ref.norm())
    return float((got - ref).norm()) / den if den > 0 else float("inf")


def bf16_sensitivity(model, prompts, fp32_logits, device, torch):
    """HF in bfloat16 (weights and activations, eager attention) against HF in
    float32 on the same prompts: prints one 'bf16-sensitivity' line per prompt
    with the relative L2 of the logits over all rows, rows 0..7 and rows 8..,
    the worst row and the argmax agreement. Converts `model` in place."""
    model.to(torch.bfloat16)
    for name, ids in prompts.items():
        ref = fp32_logits[name]
        with torch.no_grad():
            got = model(input_ids=torch.tensor([ids], device=device)).logits[0].float().cpu()
        T = ref.shape[0]
        rows = [rel_l2(got[r], ref[r]) for r in range(T)]
        late = f"{rel_l2(got[8:], ref[8:]):.3e}" if T > 8 else "-"
        same = int((got.argmax(dim=-1) == ref.argmax(dim=-1)).sum())
        print(f"bf16-sensitivity {name}: {T} tokens, HF bf16 vs HF fp32 logits rel L2 "
              f"{rel_l2(got, ref):.3e} (rows 0..7 {rel_l2(got[:8], ref[:8]):.3e}, rows 8.. {late}, "
              f"worst row {max(rows):.3e} at {rows.index(max(rows))}), argmax {same}/{T}",
              flush=True)


def main(argv):
    a = parse_args(argv)
    import torch  # imported here so that --help works without torch
    import transformers

    torch.use_deterministic_algorithms(True, warn_only=True)
    try:  # plain fp32 matmuls on the GPU (no TF32)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    except Exception:
        pass
    if a.random_weights:
        ckpt, model = write_random_checkpoint(a, torch, transformers)
        with open(os.path.join(ckpt, "config.json")) as f:
            cfg = json.load(f)
        is_mxfp4 = a.mxfp4
    else:
        ckpt = a.checkpoint
        model, is_mxfp4, cfg = load_model(ckpt, a.device, torch, transformers)
    variant = a.variant or ("mxfp4" if is_mxfp4 else "bf16")
    eos = a.eos_id
    if eos is None:
        e = cfg.get("eos_token_id")
        eos = e[0] if isinstance(e, list) else e
    tokenizer = None
    if os.path.exists(os.path.join(ckpt, "tokenizer.json")):
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(ckpt)
        except Exception as ex:  # the text is informative only
            print(f"no tokenizer ({ex}); greedy_continuation_text will be null", file=sys.stderr)
    prompts = load_prompts(a.prompts)
    os.makedirs(a.out, exist_ok=True)
    V = model.config.vocab_size

    mpath = os.path.join(a.out, "manifest.json")
    if os.path.exists(mpath):
        with open(mpath) as f:
            manifest = json.load(f)
    else:
        manifest = {
            "description": "Reference outputs computed with Hugging Face transformers "
                           "(tests/reference/make_reference.py).",
            "models": {},
            "compute": f"transformers {transformers.__version__}, torch {torch.__version__}, "
                       f"{a.device}, float32 (checkpoint weights upcast with .float()), eager "
                       "attention, no KV cache for the greedy loop",
            "logits_format": {"dtype": "float32", "endianness": "little",
                              "layout": "row-major [positions, vocab_size]", "vocab_size": V},
            "prompt_ids_file": "prompts.json",
            "greedy": f"greedy (argmax) continuation of up to {a.greedy} tokens after the prompt, "
                      f"stopping early after id {eos} if it is produced; greedy_min_margin is the "
                      "smallest top1-top2 logit gap along the way",
            "entries": [],
        }
    if a.random_weights:
        note = " (random weights; HF ran on the in-memory model" + (
            ", experts set to the dequantised MXFP4 values written)" if is_mxfp4 else ")")
    else:
        note = " (experts dequantised by transformers Mxfp4Config(dequantize=True))" if is_mxfp4 else ""
    manifest["models"][variant] = os.path.abspath(ckpt) + note

    fp32_logits = {}
    for name, ids in prompts.items():
        T = len(ids)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids], device=a.device)).logits[0].float().cpu()
        if a.bf16_sensitivity:
            fp32_logits[name] = logits
        first = max(0, T - a.last_rows) if a.last_rows > 0 else 0
        fname = f"{variant}_{name}_logits.f32.bin"
        rows = logits[first:].contiguous().numpy().astype("<f4")
        rows.tofile(os.path.join(a.out, fname))
        cont, margin, stopped = greedy(model, ids, a.greedy, eos, torch, a.device)
        try:
            with torch.no_grad():
                gen = model.generate(torch.tensor([ids], device=a.device),
                                     max_new_tokens=len(cont), do_sample=False, use_cache=True,
                                     eos_token_id=eos if stopped else None)
            cached = gen[0, T:].tolist()
        except Exception as ex:  # informative only
            print(f"generate() with a cache failed: {ex}", file=sys.stderr)
            cached = None
        entry = {
            "variant": variant, "prompt": name, "n_prompt_tokens": T, "logits_file": fname,
            "shape": [T - first, V], "positions": [first, T],
            "positions_note": "all prompt positions" if first == 0 else f"last {T - first} positions only",
            "argmax_all_positions": logits.argmax(dim=-1).tolist(),
            "logsumexp_all_positions": [round(float(x), 5) for x in torch.logsumexp(logits, dim=-1)],
            "greedy_continuation_ids": cont,
            "greedy_continuation_text": tokenizer.decode(cont) if tokenizer else None,
            "greedy_stopped_on_return": stopped,
            "greedy_min_margin": margin,
            "hf_generate_with_cache_agrees": cached == cont,
        }
        manifest["entries"] = [e for e in manifest["entries"]
                               if not (e["variant"] == variant and e["prompt"] == name)]
        manifest["entries"].append(entry)
        print(f"{variant}/{name}: {T} tokens, rows {first}..{T - 1}, greedy {len(cont)} tokens, "
              f"margin {margin:.3f}, cache agrees {cached == cont}", file=sys.stderr)

    with open(mpath, "w") as f:
        json.dump(manifest, f, indent=1)
    if a.bf16_sensitivity:
        try:  # informative only: the references above are already written
            bf16_sensitivity(model, prompts, fp32_logits, a.device, torch)
        except Exception as ex:
            print(f"bf16-sensitivity: failed: {type(ex).__name__}: {ex}", flush=True)
    ppath = os.path.join(a.out, "prompts.json")
    if not os.path.exists(ppath):
        with open(ppath, "w") as f:
            json.dump({n: {"ids": ids, "n_tokens": len(ids)} for n, ids in prompts.items()}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
