#!/usr/bin/env bash
# deploy/bundle.sh: a relocatable tarball of twain's programs and the shared
# libraries a bare node lacks, for nodes where packages cannot be installed
# (the GPU machine, HPC nodes, the container's runtime stage).
#
#   bash deploy/bundle.sh [--build-dir DIR] [--out FILE.tar.gz] [--no-build]
#                         [--system-cuda] [--with-model DIR]... [--no-default-model]
#
# Layout: twain-VERSION-linux-ARCH/{bin,lib,lib/ucx,share/twain}. Every program
# gets RUNPATH $ORIGIN/../lib, every library $ORIGIN, every UCX module
# $ORIGIN/.. so the tree runs from any directory with LD_LIBRARY_PATH empty.
# Not carried (a node has them): glibc and the loader, libgcc_s, libstdc++,
# and the NVIDIA driver's libraries (libcuda, libnvidia-*). With --system-cuda
# the CUDA toolkit's libraries (cudart, cuBLAS, NCCL, ...) are not carried
# either (nodes and images that have the toolkit: the container runtime stage).
# UCX's transport modules (libucs's ucx/ folder) are carried in lib/ucx, where
# UCX looks first (beside libucs); share/twain/env.sh also sets UCX_MODULE_DIR.
# Options:
#   --build-dir DIR   build tree (default: $TWAIN_BUILD_DIR or build)
#   --out FILE        tarball (default: DIR/twain-VERSION-linux-ARCH.tar.gz)
#   --no-build        use the build tree as it is (default: configure + build)
#   --system-cuda     do not carry the CUDA toolkit's libraries
#   --with-model DIR  also carry a model folder under share/twain/models/
#   --ucx PREFIX      carry UCX from the install PREFIX instead of the one the
#                     programs were linked with (same ABI): libucp, libucs,
#                     libuct, libucm, its ucx/ transport modules and ucx_info.
#                     For the UCX with CUDA transports (cuda_copy, cuda_ipc:
#                     the direct device-to-device KV handoff) that
#                     deploy/build_ucx_cuda.sh builds, or the container's
#                     /opt/ucx. Default: $TWAIN_UCX_PREFIX; else, for a build
#                     with the CUDA backend, build-ucx-cuda/install when
#                     deploy/build_ucx_cuda.sh has finished it; "none": the
#                     linked one. The output and the manifest say which UCX
#                     was carried, its version and whether it has the CUDA
#                     transports; a UCX with them but older than 1.14 gets a
#                     warning: its puts into device memory are emulated
#                     through host memory (about 1 GB/s), so the direct UCX
#                     path is unusable (within one host the handoff still
#                     goes direct over twain's own CUDA IPC path).
#                     build_ucx_cuda.sh builds 1.22.0 by default.
#   --no-default-model  leave out the default tiny model (17 MB), which is
#                     otherwise installed in share/twain/models/tiny-gptoss-wordnet-mxfp4,
#                     where the programs look for their default model first
#                     (relative to their own location, so the unpacked tree
#                     works from anywhere without --model)
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${TWAIN_BUILD_DIR:-build} out="" do_build=1 system_cuda=0 models=() default_model=1
ucx_prefix=${TWAIN_UCX_PREFIX:-}
while (($#)); do
  case $1 in
    --build-dir) build=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --no-build) do_build=0; shift ;;
    --system-cuda) system_cuda=1; shift ;;
    --with-model) models+=("$2"); shift 2 ;;
    --no-default-model) default_model=0; shift ;;
    --ucx) ucx_prefix=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "bundle.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
case $build in /*) ;; *) build=$here/$build ;; esac
command -v patchelf >/dev/null || { echo "bundle.sh: patchelf not found (Debian package patchelf)" >&2; exit 1; }

if ((do_build)); then
  cmake -S "$here" -B "$build" -DTWAIN_TEST_HOOKS=OFF >/dev/null
  cmake --build "$build" -j"$(nproc)"
fi

# ---- which UCX -------------------------------------------------------------------
if [ -z "$ucx_prefix" ] && [ -e "$here/build-ucx-cuda/install/.twain-ucx-cuda-done" ] &&
   env -u LD_LIBRARY_PATH ldd "$build/decode/twain-decode" 2>/dev/null | grep -q libcudart; then
  ucx_prefix=$here/build-ucx-cuda/install
fi
[ "$ucx_prefix" = none ] && ucx_prefix=""
if [ -n "$ucx_prefix" ]; then
  for l in libucp libucs libuct libucm; do
    [ -e "$ucx_prefix/lib/$l.so.0" ] || { echo "bundle.sh: --ucx $ucx_prefix: no lib/$l.so.0" >&2; exit 1; }
  done
fi

# ---- the programs ---------------------------------------------------------------
progs=()
for d in router prefill decode; do
  for f in "$build/$d"/twain*; do
    [ -f "$f" ] && [ -x "$f" ] && head -c4 "$f" | grep -q ELF && progs+=("$f")
  done
done
((${#progs[@]})) || { echo "bundle.sh: no twain programs in $build/{router,prefill,decode}: build first" >&2; exit 1; }

version=$(sed -n 's/^project(twain VERSION \([0-9.]*\).*/\1/p' "$here/CMakeLists.txt")
arch=$(uname -m)
name=twain-${version:-0}-linux-$arch
[ -n "$out" ] || out=$build/$name.tar.gz
case $out in /*) ;; *) out=$PWD/$out ;; esac
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
stage=$work/$name
mkdir -p "$stage/bin" "$stage/lib/ucx" "$stage/share/twain"

# A bare node has these; everything else a program needs is carried.
is_system_lib() { # SONAME PATH
  case $1 in
    linux-vdso.so.*|ld-linux*.so.*|libc.so.*|libm.so.*|libmvec.so.*|libpthread.so.*|libdl.so.*|\
    librt.so.*|libutil.so.*|libresolv.so.*|libanl.so.*|libnsl.so.*|libgcc_s.so.*|libstdc++.so.*) return 0 ;;
    libcuda.so.*|libnvidia-*.so*|libcudadebugger.so.*) return 0 ;;  # the NVIDIA driver
  esac
  if ((system_cuda)); then
    case $1 in libcudart.so.*|libcublas*.so.*|libnccl.so.*|libnvrtc*.so.*|libnvJitLink.so.*|libcufft*.so.*|\
               libcurand.so.*|libcusparse*.so.*|libcusolver*.so.*|libnvToolsExt.so.*) return 0 ;; esac
    case $2 in /usr/local/cuda*) return 0 ;; esac
  fi
  return 1
}

ucx_lib() { case $1 in libucp.so.*|libucs.so.*|libuct.so.*|libucm.so.*) return 0 ;; esac; return 1; }

declare -A carried=()
missing=()
collect() { # ELF [optional]: carry its dependency closure (ldd gives the whole closure)
  local elf=$1 optional=${2:-} line so path
  while IFS= read -r line; do
    case $line in
      *"=> not found"*)
        so=$(awk '{print $1}' <<<"$line")
        if [ -n "$ucx_prefix" ] && ucx_lib "$so"; then
          [ -n "${carried[$so]:-}" ] || { carried[$so]=$ucx_prefix/lib/$so; cp -L "$ucx_prefix/lib/$so" "$stage/lib/$so"; chmod u+w "$stage/lib/$so"; }
          continue
        fi
        is_system_lib "$so" "" || [ -n "$optional" ] || missing+=("$so (needed by ${elf##*/})") ;;
      *"=> /"*)
        so=$(awk '{print $1}' <<<"$line"); path=$(awk '{print $3}' <<<"$line")
        is_system_lib "$so" "$path" && continue
        case $path in */ucx/lib*) continue ;; esac   # a UCX module: carried in lib/ucx below
        if [ -n "$ucx_prefix" ] && ucx_lib "$so"; then path=$ucx_prefix/lib/$so; fi
        [ -n "${carried[$so]:-}" ] && continue
        carried[$so]=$path
        cp -L "$path" "$stage/lib/$so"
        chmod u+w "$stage/lib/$so" ;;
    esac
  done < <(env -u LD_LIBRARY_PATH ldd "$elf" 2>/dev/null || true)
}

for p in "${progs[@]}"; do cp "$p" "$stage/bin/"; collect "$p"; done
if [ -n "$ucx_prefix" ]; then   # what the carried UCX itself needs
  for l in libucp libucs libuct libucm; do collect "$ucx_prefix/lib/$l.so.0"; done
fi
ucx_info=$(command -v ucx_info || true)
[ -z "$ucx_prefix" ] || ucx_info=$ucx_prefix/bin/ucx_info
[ -x "$ucx_info" ] || ucx_info=""
if [ -n "$ucx_info" ]; then cp "$ucx_info" "$stage/bin/"; collect "$ucx_info"; fi

# UCX loads its transports (cma, ib, rdmacm, cuda_copy, cuda_ipc...) with dlopen
# from the ucx/ folder beside libucs: carry that folder and what its modules need.
if [ -n "${carried[libucs.so.0]:-}" ]; then
  ucs_dir=$(dirname "$(readlink -f "${carried[libucs.so.0]}")")
  if [ -d "$ucs_dir/ucx" ]; then
    for m in "$ucs_dir"/ucx/lib*.so*; do
      base=${m##*/}
      if [ -L "$m" ]; then ln -s "$(readlink "$m")" "$stage/lib/ucx/$base"; continue; fi
      [ -f "$m" ] || continue
      cp "$m" "$stage/lib/ucx/$base"; chmod u+w "$stage/lib/ucx/$base"
      collect "$m" optional   # e.g. the CUDA module needs libcuda: only on GPU nodes
    done
  fi
fi
if ((${#missing[@]})); then
  echo "bundle.sh: libraries not found on this machine: ${missing[*]}" >&2; exit 1
fi

# ---- relocation -----------------------------------------------------------------
# shellcheck disable=SC2016  # $ORIGIN is for the dynamic loader, not the shell
{
  for f in "$stage"/bin/*; do patchelf --set-rpath '$ORIGIN/../lib' "$f"; done
  for f in "$stage"/lib/*.so*; do patchelf --set-rpath '$ORIGIN' "$f"; done
  for f in "$stage"/lib/ucx/*.so*; do
    if [ -f "$f" ] && [ ! -L "$f" ]; then patchelf --set-rpath '$ORIGIN:$ORIGIN/..' "$f"; fi
  done
}

if ((default_model)); then models+=("$here/tests/fixtures/tiny-gptoss-wordnet-mxfp4"); fi
for m in "${models[@]}"; do
  mkdir -p "$stage/share/twain/models"
  # the default model may also have been named with --with-model: once
  [ -e "$stage/share/twain/models/$(basename "$m")" ] || cp -rL "$m" "$stage/share/twain/models/$(basename "$m")"
done
# The API for clients in other languages: the .proto files, their descriptor
# set (what the Python client builds its classes from) and the Python client
# module with its example (share/twain/python: runs as is, docs/api.md).
mkdir -p "$stage/share/twain/proto" "$stage/share/twain/python"
cp "$here"/proto/*.proto "$stage/share/twain/proto/"
if [ -f "$build/tests/service/twain.desc" ]; then
  cp "$build/tests/service/twain.desc" "$stage/share/twain/proto/twain.desc"
else
  protoc_c=$(command -v protoc-c || command -v protoc-gen-c || true)
  [ -n "$protoc_c" ] || { echo "bundle.sh: no twain.desc in the build and no protoc-c to make it" >&2; exit 1; }
  "$protoc_c" --descriptor_set_out="$stage/share/twain/proto/twain.desc" -I"$here" "$here"/proto/*.proto
fi
cp "$here/proto/python/twain_client.py" "$here/tests/service/client_example.py" "$stage/share/twain/python/"
cat > "$stage/share/twain/env.sh" <<'EOF'
# Source this to put the bundle first on PATH (no LD_LIBRARY_PATH needed: the
# programs find their libraries through RUNPATH $ORIGIN/../lib).
twain_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
export PATH="$twain_root/bin:$PATH"
export UCX_MODULE_DIR="$twain_root/lib/ucx"
export NCCL_NVLS_ENABLE=0
EOF
# The carried UCX's version: from its own ucx_info (1.13 prints "# Version X",
# later releases "# Library version: X"), else from its pkg-config file.
ucx_version=""
if [ -x "$stage/bin/ucx_info" ]; then
  ucx_version=$(env -i PATH=/usr/bin:/bin LD_LIBRARY_PATH= UCX_MODULE_DIR="$stage/lib/ucx" "$stage/bin/ucx_info" -v 2>/dev/null |
    sed -nE 's/^# (Library version:|Version) ([0-9]+\.[0-9]+[0-9.]*).*/\2/p' | head -1 || true)
fi
if [ -z "$ucx_version" ]; then
  if [ -n "$ucx_prefix" ]; then
    ucx_version=$(sed -n 's/^Version: *//p' "$ucx_prefix/lib/pkgconfig/ucx.pc" 2>/dev/null | head -1 || true)
  else
    ucx_version=$(pkg-config --modversion ucx 2>/dev/null || true)
  fi
fi
ucx_cuda=0
compgen -G "$stage/lib/ucx/libuct_cuda.so*" >/dev/null && ucx_cuda=1
ucx_warning=""
if ((ucx_cuda)) && [[ $ucx_version =~ ^([0-9]+)\.([0-9]+) ]] &&
   ((BASH_REMATCH[1] < 1 || (BASH_REMATCH[1] == 1 && BASH_REMATCH[2] < 14))); then
  ucx_warning="UCX $ucx_version has the CUDA transports but is older than 1.14: its puts into device memory are emulated (copied through host memory, about 1 GB/s), so the direct UCX path (direct ucx cuda_ipc) is unusable; within one host the KV handoff still goes direct over twain's own CUDA IPC path (direct cuda_ipc). bash deploy/build_ucx_cuda.sh builds UCX 1.22.0 (docs/operations.md, UCX's own CUDA transports)"
fi
{
  echo "twain $version bundle, built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(. /etc/os-release && echo "$PRETTY_NAME") ($(ldd --version | head -1))"
  echo "commit $(git -C "$here" rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "programs: $(cd "$stage/bin" && echo *)"
  echo "carried libraries (soname <- source):"
  for so in $(printf '%s\n' "${!carried[@]}" | sort); do echo "  $so <- ${carried[$so]}"; done
  echo "UCX modules: $(cd "$stage/lib/ucx" && echo *)"
  if ((ucx_cuda)); then
    if [ -n "$ucx_warning" ]; then
      echo "UCX: ${ucx_prefix:-as linked}, version ${ucx_version:-unknown}, with CUDA transports (but its puts into device memory are emulated: see the warning)"
    else
      echo "UCX: ${ucx_prefix:-as linked}, version ${ucx_version:-unknown}, with CUDA transports (direct device-to-device KV handoff)"
    fi
  else
    echo "UCX: ${ucx_prefix:-as linked}, version ${ucx_version:-unknown}, without CUDA transports (device KV pools are staged)"
  fi
  [ -z "$ucx_warning" ] || echo "UCX warning: $ucx_warning"
} > "$stage/share/twain/MANIFEST.txt"

# ---- check: every carried dependency resolves inside the tree -------------------
bad=0
for f in "$stage"/bin/* "$stage"/lib/*.so* "$stage"/lib/ucx/*.so.*.*; do
  [ -L "$f" ] && continue
  while IFS= read -r line; do
    so=$(awk '{print $1}' <<<"$line")
    case $line in
      *"=> not found"*) is_system_lib "$so" "" || { echo "bundle.sh: ${f#"$work"/} needs $so: not found" >&2; bad=1; } ;;
      *"=> /"*)
        path=$(awk '{print $3}' <<<"$line")
        if [ -n "${carried[$so]:-}" ] && [ "$(readlink -f "$path")" != "$(readlink -f "$stage/lib/$so")" ]; then
          echo "bundle.sh: ${f#"$work"/} takes $so from $path, not from the bundle" >&2; bad=1
        fi ;;
    esac
  done < <(env -u LD_LIBRARY_PATH ldd "$f" 2>/dev/null || true)
done
((bad == 0)) || exit 1

mkdir -p "$(dirname "$out")"
tar -C "$work" -czf "$out" "$name"
echo "bundle.sh: $out ($(du -h "$out" | cut -f1); ${#progs[@]} programs, ${#carried[@]} libraries, $(find "$stage/lib/ucx" -name '*.so*' | wc -l) UCX modules)"
ucx_with=without
((ucx_cuda == 0)) || ucx_with=with
echo "bundle.sh: UCX ${ucx_version:-of unknown version} (${ucx_prefix:-as linked}), $ucx_with CUDA transports"
[ -z "$ucx_warning" ] || echo "bundle.sh: warning: $ucx_warning" >&2
