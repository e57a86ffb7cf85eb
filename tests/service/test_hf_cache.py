"""--model takes a Hugging Face id, resolved from a fake local cache laid out as
huggingface_hub writes it (HUB/models--ORG--NAME/{refs/main, snapshots/COMMIT/
-> ../../blobs/HASH}): HF_HOME, HF_HUB_CACHE over HF_HOME, @REVISION as a ref
and as a commit, a single snapshot without refs; a missing id is exit 2 with
the cache directory looked in and the download command; `twain serve --model
ORG/NAME` serves from the cache (ready, then a greedy generate equal to the one
from the directory). Every wait is bounded."""
import os
import signal
import subprocess
import tempfile

import fixtures
import svc
from svc import check, finish

TWAIN = svc.bin_path("router", "twain")
FILES = ["config.json", "tokenizer.json", "model.safetensors", "generation_config.json"]


def make_repo(hub, org, name, commit, ref="main"):
    """A cache entry whose snapshot files are relative links into blobs/."""
    repo = os.path.join(hub, "models--%s--%s" % (org, name))
    os.makedirs(os.path.join(repo, "blobs"), exist_ok=True)
    snap = os.path.join(repo, "snapshots", commit)
    os.makedirs(snap, exist_ok=True)
    for i, f in enumerate(FILES):
        blob = os.path.join(repo, "blobs", "%040x" % (i + 1))
        if not os.path.exists(blob):
            os.symlink(os.path.join(svc.MODEL, f), blob)
        os.symlink(os.path.join("..", "..", "blobs", "%040x" % (i + 1)), os.path.join(snap, f))
    if ref:
        os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
        with open(os.path.join(repo, "refs", ref), "w") as fh:
            fh.write(commit)  # huggingface_hub writes the hash without a newline
    return repo


def run(argv, env, stdin="hello world", timeout=60):
    e = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and not k.startswith("TWAIN_")
         and k not in ("XDG_CACHE_HOME", "HOME")}
    e["TWAIN_LOG"] = "info"
    e.update(env)
    return subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=timeout, env=e)


tmp = tempfile.mkdtemp(prefix="tw_hf_")
home = os.path.join(tmp, "home")
hub = os.path.join(home, "hub")
make_repo(hub, "openai", "gpt-oss-20b", "a" * 40)
make_repo(hub, "openai", "gpt-oss-20b", "b" * 40, ref="v2")
make_repo(hub, "someorg", "norefs", "c" * 40, ref=None)
want = run([TWAIN, "tokenize", "--model", svc.MODEL], {})
check(want.returncode == 0 and want.stdout.startswith("["), "tokenize from the directory: %r" % want.stdout[:60])

for spec, env, what in (("openai/gpt-oss-20b", {"HF_HOME": home}, "HF_HOME, refs/main"),
                        ("openai/gpt-oss-20b@v2", {"HF_HOME": home}, "@ref"),
                        ("openai/gpt-oss-20b@" + "b" * 40, {"HF_HOME": home}, "@commit"),
                        ("someorg/norefs", {"HF_HOME": home}, "one snapshot, no refs"),
                        ("openai/gpt-oss-20b", {"HF_HUB_CACHE": hub, "HF_HOME": os.path.join(tmp, "empty")},
                         "HF_HUB_CACHE over HF_HOME"),
                        ("openai/gpt-oss-20b", {"XDG_CACHE_HOME": os.path.join(tmp, "xdg"), "HOME": tmp},
                         "XDG_CACHE_HOME/huggingface/hub"),
                        ("openai/gpt-oss-20b", {"HOME": os.path.join(tmp, "h")}, "~/.cache/huggingface/hub")):
    if "XDG_CACHE_HOME" in env and not os.path.exists(os.path.join(tmp, "xdg")):
        os.makedirs(os.path.join(tmp, "xdg", "huggingface"))
        os.symlink(hub, os.path.join(tmp, "xdg", "huggingface", "hub"))
    if env.get("HOME") == os.path.join(tmp, "h") and not os.path.exists(os.path.join(tmp, "h")):
        os.makedirs(os.path.join(tmp, "h", ".cache", "huggingface"))
        os.symlink(hub, os.path.join(tmp, "h", ".cache", "huggingface", "hub"))
    r = run([TWAIN, "tokenize", "--model", spec], env)
    check(r.returncode == 0 and r.stdout == want.stdout,
          "tokenize --model %s (%s): rc %d %r" % (spec, what, r.returncode, (r.stderr or r.stdout)[-200:]))

# a missing id: exit 2, the directory looked in and how to get it
for argv in ([TWAIN, "tokenize", "--model", "openai/gpt-oss-120b"],
             [svc.bin_path("decode", "twain-decode"), "--router", "tcp://127.0.0.1:9", "--model=openai/gpt-oss-120b"],
             [svc.bin_path("router", "twain-router"), "--model", "openai/gpt-oss-120b"]):
    r = run(argv, {"HF_HOME": home}, timeout=30)
    repo = os.path.join(hub, "models--openai--gpt-oss-120b")
    check(r.returncode == 2 and "--model 'openai/gpt-oss-120b' is not a directory, and not in the Hugging Face cache"
          in r.stderr and repo in r.stderr and "hf download openai/gpt-oss-120b" in r.stderr
          and "HF_HOME" in r.stderr, "%s: missing id: exit 2, %r" % (os.path.basename(argv[0]), r.stderr.strip()[-300:]))
r = run([TWAIN, "tokenize", "--model", "openai/gpt-oss-20b@nosuchref"], {"HF_HOME": home})
check(r.returncode == 2 and "no snapshot for revision nosuchref" in r.stderr
      and "hf download openai/gpt-oss-20b --revision nosuchref" in r.stderr, "unknown revision: %r" % r.stderr.strip()[-200:])

# twain serve from the cache: the same greedy answer as from the directory
e = dict(os.environ)
e["HF_HOME"] = home
serve = svc.Proc([TWAIN, "serve", "--model", "openai/gpt-oss-20b", "--backend", "cpu", "--threads", "1",
                  "--listen", "tcp://127.0.0.1:0", "--metrics-port", "-1", "--http-port", "-1"], "serve", env=e)
ep = serve.wait_line(r"twain serve: ready.*clients at (\S+)", 90).group(1)
check(ep.startswith("tcp://127.0.0.1:"), "twain serve --model openai/gpt-oss-20b: ready at %s" % ep)
ids = fixtures.ids("short_dog")
g = subprocess.run([TWAIN, "generate", "--endpoint", ep, "--max-tokens", "6"] + [str(i) for i in ids],
                   capture_output=True, text=True, timeout=60)
ref = svc.reference_generate(ids, 6, tmpdir=tmp)
got = [int(x) for x in g.stdout.split()] if g.returncode == 0 else None
check(got is not None and got == ref, "generate through the cached model: %s, reference %s" % (got, ref))
rc = serve.stop(signal.SIGTERM, 30)
check(rc == 0, "serve stops cleanly (rc %s)" % rc)
finish()
