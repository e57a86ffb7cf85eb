#!/usr/bin/env bash
# deploy/dev.sh: install what twain needs on Debian 12, build it, and either
# run the main job (demo) or the tests (test). Idempotent; used by README and CI.
#   bash deploy/dev.sh demo   # twain serve (default tiny model) + one chat request (protobuf) + one over HTTP
#   bash deploy/dev.sh test   # full ctest suite (GPU tests skip without a GPU)
#   bash deploy/dev.sh build  # dependencies + build only
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$here"
build=${TWAIN_BUILD_DIR:-build}

PKGS="build-essential cmake pkg-config git libzmq3-dev libprotobuf-c-dev protobuf-c-compiler
      libucx-dev ucx-utils libpcre2-dev libcjson-dev libmicrohttpd-dev libcmocka-dev
      python3 python3-zmq python3-protobuf libopenmpi-dev openmpi-bin curl
      shellcheck patchelf slurm-wlm munge clang libclang-rt-14-dev"

install_deps() {
  local missing=()
  for p in $PKGS; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  # Node.js and npm (tokenizer reference, manifest validators): keep a node
  # that is already there (it may come from elsewhere with npm built in).
  command -v node >/dev/null 2>&1 || missing+=(nodejs)
  command -v npm >/dev/null 2>&1 || missing+=(npm)
  if ((${#missing[@]})); then
    echo "dev.sh: installing ${missing[*]}" >&2
    local sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

do_build() {
  local werror=OFF; [ "${CI:-}" = true ] && werror=ON
  cmake -S . -B "$build" -DTWAIN_WERROR=$werror ${TWAIN_CMAKE_ARGS:-} >/dev/null
  cmake --build "$build" -j"$(nproc)"
}

case "${1:-demo}" in
  build) install_deps; do_build ;;
  test)
    install_deps; do_build
    cd "$build" && ctest --output-on-failure -j"$(nproc)" ${TWAIN_CTEST_ARGS:-} ;;
  demo)
    install_deps; do_build
    # twain serve (default tiny model, default endpoint) in the background,
    # wait for its "ready" line, one chat request with default flags, stop it.
    log=$(mktemp); trap 'rm -f "$log"' EXIT
    "$build/router/twain" serve "${@:2}" >"$log" 2>&1 & pid=$!
    for _ in $(seq 1200); do
      grep -q 'twain serve: ready' "$log" && break
      kill -0 "$pid" 2>/dev/null || { cat "$log" >&2; exit 1; }
      sleep 0.1
    done
    grep -q 'twain serve: ready' "$log" || { echo "dev.sh: twain serve not ready after 120 s" >&2; cat "$log" >&2; kill "$pid"; exit 1; }
    grep 'twain serve: ready' "$log"
    rc=0; "$build/router/twain" chat "What does the word 'dog' mean?" || rc=$?
    # the same service over its OpenAI-compatible HTTP API (docs/api.md)
    url=$(sed -n 's|.*serving the OpenAI API on \(http://[^ ]*/v1\).*|\1|p' "$log" | head -n1)
    if [ -n "$url" ]; then
      echo "POST $url/chat/completions"
      curl -sS --max-time 120 "$url/chat/completions" -H 'Content-Type: application/json' \
        -d '{"max_tokens": 128, "reasoning_effort": "low", "messages": [{"role": "user", "content": "What does the word dog mean?"}]}' || rc=$?
      echo
    fi
    kill -TERM "$pid"; wait "$pid" || rc=$?
    exit $rc ;;
  *) echo "usage: deploy/dev.sh demo|test|build" >&2; exit 2 ;;
esac
