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
: > /tmp/.twain-empty-$$
mkdir -p /tmp/.twain-emptydir-$$
masked=0
while read -r so arrow path; do
  [ "$arrow" = "<-" ] || continue
  real=$(readlink -f "$path")
  mount --bind /tmp/.twain-empty-$$ "$real" && masked=$((masked + 1))
  case $so in libucs.so.*) ucxdir=$(dirname "$real")/ucx
    [ -d "$ucxdir" ] && mount --bind /tmp/.twain-emptydir-$$ "$ucxdir" ;; esac
done < <(sed -n 's/^  \(lib[^ ]*\) \(<-\) \(.*\)$/\1 \2 \3/p' "$man")
echo "masked $masked system libraries"
cd /
if env -i PATH=/usr/bin:/bin "$prefill" --help >/dev/null 2>&1; then
  echo "CONTROL-STARTED"   # the masking did not bite
fi
env -i PATH=/usr/bin:/bin LD_LIBRARY_PATH= "$root/bin/twain-prefill" --help > /tmp/.twain-help-$$ 2>&1
echo "help-rc $? $(grep -c -- --model /tmp/.twain-help-$$)"
env -i PATH=/usr/bin:/bin LD_LIBRARY_PATH= "$root/bin/ucx_info" -d 2>/dev/null | grep -q "Transport: cma" && echo "UCX-CMA-LOADED"
echo "tokens $(env -i PATH=/usr/bin:/bin LD_LIBRARY_PATH= timeout 60 "$root/bin/twain-prefill" \
  --model "$root/share/twain/models/tiny-gptoss-wordnet-mxfp4" --backend cpu --threads 1 \
  --prompt-tokens "$prompt" --generate 8 2>/dev/null | tail -1)"
rm -f /tmp/.twain-empty-$$ /tmp/.twain-help-$$; rmdir /tmp/.twain-emptydir-$$
EOF
if [ "$(id -u)" = 0 ] && unshare -m true 2>/dev/null; then
  out=$(timeout 120 unshare -m bash "$tmp/bare.sh" "$root" "$man" "$prefill" "$tmp/prompt.json")
  echo "$out"
  check "system copies masked" 'grep -Eq "^masked [1-9]" <<<"$out"'
  check "control: the unbundled program cannot start on the bare node" '! grep -q CONTROL-STARTED <<<"$out"'
  check "bundled twain-prefill --help runs from / with LD_LIBRARY_PATH empty" 'grep -Eq "^help-rc 0 [1-9]" <<<"$out"'
  check "UCX loads its cma transport from the bundle" 'grep -q UCX-CMA-LOADED <<<"$out"'
  check "bundled greedy tokens equal the build tree's" '[ "$(sed -n "s/^tokens //p" <<<"$out")" = "$ref" ]'
else
  echo "note: not root or no unshare: checking without masking the system libraries"
  out=$(cd / && env -i PATH=/usr/bin:/bin LD_LIBRARY_PATH= "$root/bin/twain-prefill" --help 2>&1)
  check "bundled twain-prefill --help runs from / with LD_LIBRARY_PATH empty" 'grep -q -- --model <<<"$out"'
fi
for p in "$root"/bin/twain*; do
  check "$(basename "$p") --help exits 0" '(cd / && env -i PATH=/usr/bin:/bin LD_LIBRARY_PATH= "$p" --help >/dev/null 2>&1)'
done
echo "bundle_test: $fails failure(s)"
[ "$fails" = 0 ]
