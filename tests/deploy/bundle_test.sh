#!/usr/bin/env bash
# bundle_test.sh BUILD_DIR SRC_DIR: deploy/bundle.sh makes a tarball whose
# programs run from another directory with an empty LD_LIBRARY_PATH on a node
# that lacks the carried libraries. The "bare node" is simulated in a private
# mount namespace (unshare -m, root only) where every system copy of a carried
# library, and the system UCX module folder, is masked by an empty file or
# folder; a control run of the unbundled build-tree program must then fail,
# and the bundled one must give the same greedy tokens as outside. Exit 77
# when the programs are not built yet.
# shellcheck disable=SC2016  # check() evaluates its single-quoted condition later
set -euo pipefail
build=$1 src=$2
prefill=$build/prefill/twain-prefill
[ -x "$prefill" ] || { echo "SKIP: $prefill not built yet"; exit 77; }
command -v patchelf >/dev/null || { echo "SKIP: patchelf not installed (deploy/dev.sh PKGS)"; exit 77; }
model=$src/tests/fixtures/tiny-gptoss-wordnet-mxfp4
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
check() { if eval "$2"; then echo "ok: $1"; else echo "FAIL: $1"; fails=$((fails + 1)); fi; }

timeout 240 bash "$src/deploy/bundle.sh" --build-dir "$build" --no-build --system-cuda \
  --with-model "$model" --out "$tmp/out/twain.tar.gz"
mkdir -p "$tmp/node"
tar -xzf "$tmp/out/twain.tar.gz" -C "$tmp/node"
root=$(echo "$tmp"/node/twain-*)
man=$root/share/twain/MANIFEST.txt
check "bundle has a manifest" '[ -s "$man" ]'
check "UCX modules carried" 'ls "$root"/lib/ucx/libuct_*.so.0 >/dev/null 2>&1'
check "manifest names the carried UCX's version" 'grep -Eq "^UCX: .*, version [0-9]+\.[0-9]+\.[0-9]+, with(out)? CUDA transports" "$man"'
check "RUNPATH \$ORIGIN/../lib on twain-prefill" \
  'readelf -d "$root/bin/twain-prefill" | grep -q "RUNPATH.*\[\$ORIGIN/../lib\]"'

# Reference tokens from the build tree, on this (complete) machine.
echo '[1, 2, 3, 4]' > "$tmp/prompt.json"
ref=$(timeout 60 "$prefill" --model "$model" --backend cpu --threads 1 \
      --prompt-tokens "$tmp/prompt.json" --generate 8 2>/dev/null | tail -1)
check "reference run produced tokens ($ref)" '[[ "$ref" == \[*\] ]]'

# The bare-node run, in a private mount namespace.
cat > "$tmp/bare.sh" <<'EOF'
set -uo pipefail
root=$1 man=$2 prefill=$3 prompt=$4
# Mask the system copy of every carried library, and the system UCX modules.
# mount itself (and grep, sed...) may need some of them: mask those last, and
# use only bash builtins and coreutils afterwards.
empty=$(mktemp /tmp/twain-empty.XXXXXX) emptydir=$(mktemp -d /tmp/twain-emptydir.XXXXXX)
mount_needs=$(ldd "$(command -v mount)" 2>/dev/null)
first=() last=() ucxdir=""
while read -r so arrow path; do
  [ "$arrow" = "<-" ] || continue
  real=$(readlink -f "$path")
  case $so in libucs.so.*) [ -d "$(dirname "$real")/ucx" ] && ucxdir=$(dirname "$real")/ucx ;; esac
  case $mount_needs in *"$so "*) last+=("$real") ;; *) first+=("$real") ;; esac
done < <(sed -n 's/^  \(lib[^ ]*\) \(<-\) \(.*\)$/\1 \2 \3/p' "$man")
masked=0
[ -n "$ucxdir" ] && mount --bind "$emptydir" "$ucxdir"
for f in "${first[@]}" "${last[@]}"; do mount --bind "$empty" "$f" && masked=$((masked + 1)); done
echo "masked $masked system libraries${ucxdir:+ and $ucxdir}"
cd /
if env -i PATH=/usr/bin:/bin "$prefill" --help >/dev/null 2>&1; then
  echo "CONTROL-STARTED"   # the masking did not bite
fi
help=$(env -i PATH=/usr/bin:/bin LD_LIBRARY_PATH= "$root/bin/twain-prefill" --help 2>&1); rc=$?
[[ $help == *--model* ]] && echo "help-rc $rc has-model"
ucx=$(env -i PATH=/usr/bin:/bin LD_LIBRARY_PATH= "$root/bin/ucx_info" -d 2>&1)
[[ $ucx == *"Transport: cma"* ]] && echo "UCX-CMA-LOADED"
tokens=$(env -i PATH=/usr/bin:/bin LD_LIBRARY_PATH= timeout 60 "$root/bin/twain-prefill" \
  --model "$root/share/twain/models/tiny-gptoss-wordnet-mxfp4" --backend cpu --threads 1 \
  --prompt-tokens "$prompt" --generate 8 2>/dev/null)
echo "tokens ${tokens##*$'\n'}"
echo "cleanup $empty $emptydir"
EOF
if [ "$(id -u)" = 0 ] && unshare -m true 2>/dev/null; then
  out=$(timeout 120 unshare -m bash "$tmp/bare.sh" "$root" "$man" "$prefill" "$tmp/prompt.json")
  read -r _ e d < <(grep "^cleanup " <<<"$out") && rm -f "$e" && rmdir "$d"
  echo "$out"
  ncarried=$(grep -c '^  lib[^ ]* <- ' "$man")
  check "every carried library's system copy masked ($ncarried)" 'grep -q "^masked $ncarried system libraries" <<<"$out"'
  check "control: the unbundled program cannot start on the bare node" '! grep -q CONTROL-STARTED <<<"$out"'
  check "bundled twain-prefill --help runs from / with LD_LIBRARY_PATH empty" 'grep -q "^help-rc 0 has-model" <<<"$out"'
  check "UCX loads its cma transport from the bundle" 'grep -q UCX-CMA-LOADED <<<"$out"'
  check "bundled greedy tokens equal the build tree's" '[ "$(sed -n "s/^tokens //p" <<<"$out")" = "$ref" ]'
else
  echo "note: not root or no unshare: checking without masking the system libraries"
  out=$(cd / && env -i PATH=/usr/bin:/bin LD_LIBRARY_PATH= "$root/bin/twain-prefill" --help 2>&1)
  check "bundled twain-prefill --help runs from / with LD_LIBRARY_PATH empty" 'grep -q -- --model <<<"$out"'
fi
deflt=$root/share/twain/models/tiny-gptoss-wordnet-mxfp4
out=$(cd / && env -i PATH=/usr/bin:/bin LD_LIBRARY_PATH= "$root/bin/twain-prefill" --help 2>&1)
check "bundled twain-prefill's default model is the bundle's own ($deflt)" 'grep -qF -- "$deflt" <<<"$out"'
for p in "$root"/bin/twain*; do
  check "$(basename "$p") --help exits 0" '(cd / && env -i PATH=/usr/bin:/bin LD_LIBRARY_PATH= "$p" --help >/dev/null 2>&1)'
done
# The Python client example from the bundle alone: its module and descriptor
# set are found beside it, against the bundled `twain serve`.
check "bundle ships the .proto files and the descriptor set" \
  '[ -s "$root/share/twain/proto/twain_api.proto" ] && [ -s "$root/share/twain/proto/twain.desc" ]'
(cd / && env -i PATH=/usr/bin:/bin HOME="$tmp" LD_LIBRARY_PATH= timeout 120 "$root/bin/twain" serve --backend cpu \
   --threads 1 --listen tcp://127.0.0.1:0 --metrics-port -1 --http-port -1 >"$tmp/serve.out" 2>&1) &
serve_pid=$!
ep=""
for _ in $(seq 1 600); do
  ep=$(sed -n 's/.*twain serve: ready.*clients at \(tcp:[^ ]*\).*/\1/p' "$tmp/serve.out")
  [ -n "$ep" ] && break
  kill -0 "$serve_pid" 2>/dev/null || break
  sleep 0.1
done
check "bundled twain serve is ready ($ep)" '[ -n "$ep" ]'
ex=$(cd / && env -i PATH=/usr/bin:/bin timeout 120 python3 "$root/share/twain/python/client_example.py" \
     --endpoint "$ep" "What does the word 'book' mean?" 2>&1) || true
check "the bundle's Python client example answers: ${ex:0:160}" 'grep -q "usage: prompt" <<<"$ex"'
imp=$(cd / && env -i PATH=/usr/bin:/bin PYTHONPATH="$root/share/twain/python" python3 -c \
      'import twain_client; print(twain_client.find_descriptor_set())' 2>&1) || true
check "twain_client imports from the bundle and finds its descriptor set ($imp)" \
  '[ "$(readlink -f "$imp")" = "$(readlink -f "$root/share/twain/proto/twain.desc")" ]'
pkill -TERM -P "$serve_pid" 2>/dev/null || true
kill -TERM "$serve_pid" 2>/dev/null || true
wait "$serve_pid" 2>/dev/null || true
echo "bundle_test: $fails failure(s)"
[ "$fails" = 0 ]
