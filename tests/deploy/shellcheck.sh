#!/usr/bin/env bash
# Lint every shell script of the deployment area (argument: the source tree) with
# Debian's shellcheck (bookworm: 0.9.0).
set -euo pipefail
src=$1
command -v shellcheck >/dev/null || { echo "SKIP: shellcheck not installed (deploy/dev.sh PKGS installs it)"; exit 77; }
shellcheck --version | sed -n 2p
mapfile -t files < <(cd "$src" && ls deploy/bundle.sh deploy/build_ucx_cuda.sh deploy/slurm/*.sh deploy/slurm/*.sbatch tests/deploy/*.sh 2>/dev/null)
(cd "$src" && shellcheck -x -s bash "${files[@]}")
echo "shellcheck: ${#files[@]} scripts clean"
