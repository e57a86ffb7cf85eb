#!/usr/bin/env bash
# sdk_setup.sh SRC_DIR DEST_DIR: install the pinned OpenAI Node SDK
# (SRC_DIR/package-lock.json) into DEST_DIR with `npm ci`, once per lock file,
# next to a copy of http_sdk.mjs. A ctest fixture of test_http_sdk.
set -euo pipefail
src=$1 dest=$2
command -v npm >/dev/null || { echo "sdk_setup: npm not found (deploy/dev.sh installs nodejs and npm)" >&2; exit 1; }
mkdir -p "$dest"
cp "$src/package.json" "$src/package-lock.json" "$src/http_sdk.mjs" "$dest/"
want=$(sha256sum "$src/package-lock.json" | cut -d' ' -f1)
if [ "$(cat "$dest/node_modules/.twain-lock.sha256" 2>/dev/null)" != "$want" ]; then
  (cd "$dest" && timeout 240 npm ci --no-audit --no-fund --loglevel=error)
  echo "$want" > "$dest/node_modules/.twain-lock.sha256"
fi
echo "sdk_setup: node $(node --version), openai $(node -p "require('$dest/node_modules/openai/package.json').version")"
