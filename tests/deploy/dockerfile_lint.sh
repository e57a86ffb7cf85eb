#!/usr/bin/env bash
# dockerfile_lint.sh TOOLS_DIR DOCKERFILE: lint the container recipe with the
# two pinned npm linters (dockerfile-utils: instruction syntax and semantics,
# as in VS Code's Docker support; dockerfilelint: best practices such as apt
# caches and pinned base tags), then check the project's own rules for the
# image. No container engine exists here, so the image itself is never built.
set -euo pipefail
tools=$1 df=$2
du="$tools/node_modules/.bin/dockerfile-utils" dl="$tools/node_modules/.bin/dockerfilelint"
fails=0
lint() { # FILE -> 0 when both linters are silent
  local f=$1 out rc=0
  out=$("$du" lint "$f" 2>&1) || rc=1
  if [ -n "$out" ]; then echo "$out"; rc=1; fi
  "$dl" "$f" >/tmp/dockerfilelint.$$ 2>&1 || { cat /tmp/dockerfilelint.$$; rc=1; }
  rm -f /tmp/dockerfilelint.$$
  return $rc
}
# Self-test: the linters must flag a broken recipe, or a pass proves nothing.
bad=$(mktemp); trap 'rm -f "$bad"' EXIT
printf 'FROM ubuntu\nMAINTAINER someone\nRUN apt-get update\nEXPOSE 99999\nCMD a\nCMD b\n' > "$bad"
if lint "$bad" >/dev/null 2>&1; then echo "FAIL self-test: the linters accepted a broken Dockerfile"; fails=$((fails + 1)); fi
if ! "$du" lint "$bad" | grep -q MAINTAINER; then echo "FAIL self-test: dockerfile-utils did not flag MAINTAINER"; fails=$((fails + 1)); fi
if lint "$df"; then echo "linters: $df clean"; else echo "FAIL linters flagged $df"; fails=$((fails + 1)); fi
# Project rules.
rule() { if grep -Eq -e "$2" "$df"; then echo "rule ok: $1"; else echo "FAIL rule: $1"; fails=$((fails + 1)); fi; }
rule "multi-stage (3 named stages)" '^FROM .* AS runtime$'
[ "$(grep -Ec '^FROM .* AS [a-z]+$' "$df")" -ge 3 ] || { echo "FAIL rule: fewer than 3 named stages"; fails=$((fails + 1)); }
rule "CUDA base image" '^FROM nvidia/cuda:\$\{CUDA_VERSION\}-runtime-'
rule "UCX built with CUDA" '--with-cuda=/usr/local/cuda'
rule "UCX CUDA transport checked" 'test -e /opt/ucx/lib/ucx/libuct_cuda.so'
rule "UCX from the upstream release tag" '^ARG UCX_TAG=v[0-9]+\.[0-9]+\.[0-9]+$'
rule "UCX tag's commit pinned" '^ARG UCX_COMMIT=[0-9a-f]{40}$'
rule "UCX clone refused unless at the pinned commit" 'test "\$\(git -C ucx rev-parse HEAD\)" = "\$\{UCX_COMMIT\}"'
# the image and deploy/build_ucx_cuda.sh (the bundles' UCX) build the same release
script=$(dirname "$df")/../build_ucx_cuda.sh
tag=$(sed -n 's/^ARG UCX_TAG=//p' "$df") commit=$(sed -n 's/^ARG UCX_COMMIT=//p' "$df")
if [ -f "$script" ] && ! grep -Eq "ucx_tag=$tag ucx_commit=$commit\b" "$script"; then
  echo "FAIL rule: the Dockerfile's UCX ($tag $commit) is not deploy/build_ucx_cuda.sh's"; fails=$((fails + 1))
else
  echo "rule ok: UCX $tag ($commit), as deploy/build_ucx_cuda.sh"
fi
rule "NVLink multicast off" 'NCCL_NVLS_ENABLE=0'
rule "bundle built by deploy/bundle.sh" 'deploy/bundle.sh'
last_user=$(grep -E '^USER ' "$df" | tail -1 | awk '{print $2}')
case "${last_user%%:*}" in
  ""|0|root) echo "FAIL rule: the runtime user must not be root (USER is '${last_user}')"; fails=$((fails + 1)) ;;
  *) echo "rule ok: runtime user ${last_user}" ;;
esac
[ "$(awk '/^FROM /{s=$NF} /^USER /{u=s} END{print u}' "$df")" = runtime ] || { echo "FAIL rule: USER is not set in the runtime stage"; fails=$((fails + 1)); }
echo "dockerfile_lint: $fails failure(s)"
[ "$fails" = 0 ]
