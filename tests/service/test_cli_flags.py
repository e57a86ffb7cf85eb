"""Every program's command line goes through the shared parser (common/base/opts.h):
- --help: exit 0, the usage on stdout (nothing on stderr), the options each
  program must have listed;
- --version: "PROG 0.1.0" on stdout, exit 0;
- every integer or number option (the --help rows with a numeric default) is
  strict: --opt=12abc and --opt 12abc exit 2 naming the option and the value,
  and so does the environment variable TWAIN_<PROG>_<OPT>=12abc;
- --opt=value is taken: a model path given as --model=/nonexistent/... is the
  one the program reports missing, a client's --endpoint=... is the one it
  tries;
- --config FILE for the daemons and `twain serve`: a number in it is strict
  (FILE:LINE named), a path in it is used.
No server is started: each program stops at its first error. Every wait is
bounded."""
import concurrent.futures
import os
import re
import socket
import subprocess
import tempfile

import svc
from svc import check, finish

TWAIN = svc.bin_path("router", "twain")


def prog(cmd, env_prefix, must, config=False, positional=()):
    return {"cmd": cmd, "env": env_prefix, "must": must, "config": config, "pos": list(positional)}


PROGS = [
    prog([TWAIN, "serve"], "TWAIN_SERVE_", ["--model", "--kv-blocks", "--metrics-port", "--max-requests",
                                            "--deadline-ms", "--default-max-tokens", "--max-prompt-tokens",
                                            "--max-tokens-limit", "--decode-dp"], config=True),
    prog([TWAIN, "chat"], "TWAIN_CHAT_", ["--endpoint", "--max-tokens", "--reasoning", "--timeout-ms"],
         positional=["hi"]),
    prog([TWAIN, "generate"], "TWAIN_GENERATE_", ["--endpoint", "--max-tokens", "--stop-ids", "--seed"],
         positional=["1"]),
    prog([TWAIN, "bench"], "TWAIN_BENCH_", ["--endpoint", "--num-requests", "--request-rate", "--dataset"]),
    prog([TWAIN, "write-checkpoint"], "TWAIN_WRITE_CHECKPOINT_", ["--preset", "--out", "--layers", "--shard-gib"]),
    prog([TWAIN, "router"], "TWAIN_ROUTER_", ["--model", "--listen", "--max-requests"], config=True),
    prog([TWAIN, "tokenize"], "TWAIN_TOKENIZE_", ["--model", "--tokenizer", "--allow-special"]),
    prog([TWAIN, "detokenize"], "TWAIN_DETOKENIZE_", ["--model", "--skip-special"]),
    prog([TWAIN, "render"], "TWAIN_RENDER_", ["--model", "--max-prompt-tokens", "--text"]),
    prog([TWAIN, "parse"], "TWAIN_PARSE_", ["--model", "--conversation", "--events"]),
    prog([svc.bin_path("router", "twain-router")], "TWAIN_ROUTER_",
         ["--model", "--metrics-port", "--max-tokens-limit", "--drain-timeout", "--prefill-window-tokens",
          "--http-port", "--api-key-file", "--disable-log-requests"], config=True),
    prog([svc.bin_path("prefill", "twain-prefill")], "TWAIN_PREFILL_",
         ["--router", "--model", "--kv-blocks", "--metrics-port", "--prompt-tokens", "--chunk-tokens"],
         config=True),
    prog([svc.bin_path("decode", "twain-decode")], "TWAIN_DECODE_",
         ["--router", "--model", "--kv-blocks", "--metrics-port", "--max-batch", "--verify-kv", "--dp"],
         config=True),
    prog([svc.bin_path("tests", "bench", "twain-bench-cpu")], "TWAIN_BENCH_CPU_", ["--model", "--threads"]),
    prog([svc.bin_path("tests", "bench", "twain-bench-router")], "TWAIN_BENCH_ROUTER_", ["--tokens"]),
    prog([svc.bin_path("tests", "bench", "twain-bench-kv-handoff")], "TWAIN_BENCH_KV_", ["--reps", "--tokens", "--device"]),
]
# built with the CUDA backend only (nvcc found at configure time)
for path, env, must in ((("tests", "bench", "twain-bench-cuda"), "TWAIN_BENCH_CUDA_", ["--steps", "--batches"]),
                        (("tests", "kernels", "twain-compare-hf"), "TWAIN_COMPARE_HF_", ["--model", "--max-rel"])):
    if os.path.exists(svc.bin_path(*path)):
        PROGS.append(prog([svc.bin_path(*path)], env, must))


def run(argv, env=None, timeout=30, stdin_text=None):
    e = dict(os.environ)
    for k in list(e):  # only the variables a check sets
        if k.startswith("TWAIN_") and k not in ("TWAIN_LOG", "TWAIN_LOG_SUBSYS"):
            del e[k]
    e.update(env or {})
    if stdin_text is not None:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=e, input=stdin_text)
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=e, stdin=subprocess.DEVNULL)


def name_of(p):
    return " ".join([os.path.basename(p["cmd"][0])] + p["cmd"][1:])


ROW = re.compile(r"^  (--[a-z0-9-]+)(?: (\S+))?\s+.*?(\(default (-?[0-9]+(?:\.[0-9]+)?(?:e[+-]?[0-9]+)?)\))?$")


def check_program(p):
    """All checks of one program; returns [(ok, what)] (run in a thread pool:
    starting ~300 processes one after another is slow on a loaded machine)."""
    out = []
    name = name_of(p)
    shown = name if p["cmd"][0] != TWAIN else "twain " + p["cmd"][1]
    r = run(p["cmd"] + ["--help"])
    out.append((r.returncode == 0 and r.stdout.startswith("usage: " + shown) and r.stderr == "",
                "%s --help: exit 0, usage on stdout, nothing on stderr (rc %d, stderr %r)" % (name, r.returncode, r.stderr[:120])))
    rows = {}
    for line in r.stdout.splitlines():
        m = ROW.match(line)
        if m:
            rows[m.group(1)] = m.group(4)
    missing = [o for o in p["must"] + ["--version"] + (["--config"] if p["config"] else []) if o not in rows]
    out.append((not missing, "%s --help lists %s (missing %s)" % (name, ", ".join(p["must"]), missing)))
    env_line = "every option also reads %s<NAME>" % p["env"]
    out.append((env_line in r.stdout, "%s --help names the environment %s<NAME>" % (name, p["env"])))
    r = run(p["cmd"] + ["--version"])
    out.append((r.returncode == 0 and r.stdout == "%s 0.1.0\n" % shown, "%s --version: %r" % (name, r.stdout)))
    numeric = [o for o, d in rows.items() if d is not None]
    out.append((len(numeric) >= 1 or name in ("twain tokenize", "twain detokenize", "twain parse"),
                "%s: numeric options found in --help: %s" % (name, numeric)))
    for k, o in enumerate(numeric):
        # every option as --opt=12abc and from the environment; the first also as --opt 12abc
        for argv in ([o + "=12abc"], [o, "12abc"])[:2 if k == 0 else 1]:
            r = run(p["cmd"] + argv + p["pos"])
            out.append((r.returncode == 2 and ("%s must be" % o) in r.stderr and "'12abc'" in r.stderr,
                        "%s %s: exit 2 naming %s and '12abc' (rc %d, %r)" % (name, " ".join(argv), o, r.returncode,
                                                                            r.stderr.strip()[-140:])))
        var = p["env"] + o[2:].upper().replace("-", "_")
        r = run(p["cmd"] + p["pos"], env={var: "12abc"})
        out.append((r.returncode == 2 and ("environment %s: %s must be" % (var, o)) in r.stderr,
                    "%s with %s=12abc: exit 2 naming both (rc %d, %r)" % (name, var, r.returncode, r.stderr.strip()[-140:])))
    r = run(p["cmd"] + ["--no-such-flag=1"] + p["pos"])
    out.append((r.returncode == 2 and "unknown option --no-such-flag" in r.stderr,
                "%s --no-such-flag=1: exit 2 naming it (rc %d)" % (name, r.returncode)))
    return out, len(numeric)


n_numeric = 0
with concurrent.futures.ThreadPoolExecutor(max_workers=6) as pool:
    for results, n in pool.map(check_program, PROGS):
        n_numeric += n
        for ok, what in results:
            check(ok, what)
check(n_numeric >= 60, "%d numeric options checked over %d programs" % (n_numeric, len(PROGS)))

# --opt=value is taken (the program fails later on exactly that value)
missing_model = "/nonexistent/tw-flags-model"
for argv in ([svc.bin_path("decode", "twain-decode"), "--router=tcp://127.0.0.1:9", "--model=" + missing_model],
             [svc.bin_path("prefill", "twain-prefill"), "--router=tcp://127.0.0.1:9", "--model=" + missing_model],
             [svc.bin_path("router", "twain-router"), "--model=" + missing_model, "--listen=tcp://127.0.0.1:0",
              "--workers=tcp://127.0.0.1:0", "--metrics-port=-1"],
             [TWAIN, "serve", "--model=" + missing_model, "--listen=tcp://127.0.0.1:0", "--metrics-port=-1"],
             [TWAIN, "tokenize", "--model=" + missing_model]):
    r = run(argv, timeout=60)
    check(r.returncode not in (0, 2) and missing_model in r.stderr,
          "%s --model=%s: that path is the one reported (rc %d)" % (os.path.basename(argv[0]), missing_model, r.returncode))
s = socket.socket()
s.bind(("127.0.0.1", 0))  # bound, never listening: nobody answers
dead = "tcp://127.0.0.1:%d" % s.getsockname()[1]
r = run([TWAIN, "chat", "--endpoint=" + dead, "--connect-timeout-ms=300", "hi"])
check(r.returncode == 1 and ("no answer from %s within 300 ms" % dead) in r.stderr,
      "chat --endpoint=EP --connect-timeout-ms=300: %r" % r.stderr.strip()[-120:])
r = run([TWAIN, "generate", "--endpoint", dead], env={"TWAIN_GENERATE_CONNECT_TIMEOUT_MS": "250"}, timeout=30)
check(r.returncode == 2 and "missing the prompt token ids" in r.stderr, "generate without ids: usage error (%r)" % r.stderr.strip()[-120:])
# ids on stdin or as arguments: a broken or nested JSON array, a stray bracket, a
# negative id are usage errors before any connection (as `twain detokenize` reads them)
for text, why in (("[1, 2", "not a JSON array"), ("1 2]", "token id must be an integer in [0, 2147483647], got '2]'"),
                  ("[[1,2]]", "element 0 of the id array"), ("[1,-2]", "element 1 of the id array"),
                  ("abc", "got 'abc'")):
    r = run([TWAIN, "generate", "--endpoint", dead], env={"TWAIN_GENERATE_CONNECT_TIMEOUT_MS": "250"}, stdin_text=text)
    check(r.returncode == 2 and why in r.stderr, "generate with %r on stdin: usage error naming it (rc %d, %r)" %
          (text, r.returncode, r.stderr.strip()[-120:]))
r = run([TWAIN, "generate", "--endpoint", dead, "--", "-5"], env={"TWAIN_GENERATE_CONNECT_TIMEOUT_MS": "250"})
check(r.returncode == 2 and "got '-5'" in r.stderr, "generate -- -5: usage error (%r)" % r.stderr.strip()[-120:])
r = run([TWAIN, "generate", "--endpoint", dead], env={"TWAIN_GENERATE_CONNECT_TIMEOUT_MS": "250"}, stdin_text="[1, 2]\n")
check(r.returncode == 1 and ("no answer from %s within 250 ms" % dead) in r.stderr,
      "generate with a JSON array on stdin: read, then the connection tried (%r)" % r.stderr.strip()[-120:])
r = run([TWAIN, "generate", "--endpoint", dead, "1,2"], env={"TWAIN_GENERATE_CONNECT_TIMEOUT_MS": "250"})
check(r.returncode == 1 and ("no answer from %s within 250 ms" % dead) in r.stderr,
      "TWAIN_GENERATE_CONNECT_TIMEOUT_MS=250 is used: %r" % r.stderr.strip()[-120:])
s.close()

# the OpenAI-compatible HTTP API: on by default in `twain serve`, on 127.0.0.1:7402
# (test_http_sdk runs it without --http-port); off by default in twain-router
r = run([TWAIN, "serve", "--help"])
rows = {m.group(1): m.group(0) for m in (ROW.match(l) for l in r.stdout.splitlines()) if m}
check(re.search(r"\(default 7402\)$", r.stdout, re.M) and "--http-port" in rows and
      "default 127.0.0.1" in rows.get("--http-addr", "") and "--served-model-name" in rows and
      "--api-key" in rows and "--api-key-file" in rows,
      "twain serve --help: --http-port (default 7402), --http-addr (default 127.0.0.1), --served-model-name, "
      "--api-key, --api-key-file")
r = run([svc.bin_path("router", "twain-router"), "--help"])
check(re.search(r"^  --http-port PORT .*\(default -1\)$", r.stdout, re.M),
      "twain-router --help: --http-port (default -1: off unless asked for)")

# --mps (router/serve_mps.h): off|auto|on; "on" where it cannot apply stops serve
# before anything starts, naming why
r = run([TWAIN, "serve", "--backend", "cpu", "--mps", "on", "--listen=tcp://127.0.0.1:0", "--metrics-port=-1"])
check(r.returncode == 2 and "--mps on: the workers run the cpu backend" in r.stderr,
      "twain serve --backend cpu --mps on: exit 2 naming the cpu backend (rc %d, %r)" % (r.returncode, r.stderr.strip()[-140:]))
r = run([TWAIN, "serve", "--backend", "cpu"], env={"TWAIN_SERVE_MPS": "sometimes"})
check(r.returncode == 2 and "must be off, auto or on, got 'sometimes'" in r.stderr,
      "TWAIN_SERVE_MPS=sometimes: exit 2 (rc %d, %r)" % (r.returncode, r.stderr.strip()[-140:]))

# --config FILE for the daemons and serve
with tempfile.TemporaryDirectory() as tmp:
    bad = os.path.join(tmp, "bad.conf")
    with open(bad, "w") as f:
        f.write("# twain-decode options\nrouter: tcp://127.0.0.1:9\nkv-blocks: 12abc\n")
    r = run([svc.bin_path("decode", "twain-decode"), "--config", bad])
    check(r.returncode == 2 and ("%s:3: --kv-blocks must be an integer" % bad) in r.stderr,
          "twain-decode --config with kv-blocks: 12abc: FILE:3 named (%r)" % r.stderr.strip()[-140:])
    good = os.path.join(tmp, "good.conf")
    for p in (q for q in PROGS if q["config"]):
        with open(good, "w") as f:
            f.write("model: %s\n" % missing_model)
            if "twain-decode" in p["cmd"][0] or "twain-prefill" in p["cmd"][0]:
                f.write("router = \"tcp://127.0.0.1:9\"\n")
            else:
                f.write("listen: tcp://127.0.0.1:0\nmetrics-port: -1\n")
            if p["cmd"][-1] in ("router",) or "twain-router" in p["cmd"][0]:
                f.write("workers: tcp://127.0.0.1:0\n")
        r = run(p["cmd"] + ["--config=" + good], timeout=60)
        check(r.returncode not in (0, 2) and missing_model in r.stderr,
              "%s --config FILE: its model path is used (rc %d, %r)" % (name_of(p), r.returncode, r.stderr.strip()[-120:]))
        r = run(p["cmd"], env={p["env"] + "CONFIG": good}, timeout=60)
        check(r.returncode not in (0, 2) and missing_model in r.stderr,
              "%s with %sCONFIG=FILE: used too (rc %d)" % (name_of(p), p["env"], r.returncode))
finish()
