#!/usr/bin/env bash
# deploy/build_ucx_cuda.sh: UCX with the CUDA transports (cuda_copy, cuda_ipc:
# libuct_cuda), for carrying to the GPU machine (Debian's libucx0 has no CUDA
# transports; MACHINES.md "UCX with CUDA"). Three sources:
#   - by default the upstream release UCX 1.22.0: the tag v1.22.0 of
#     https://github.com/openucx/ucx, cloned (git clone --depth 1 --branch
#     v1.22.0) into build-ucx-cuda/ucx-1.22.0-git; the build is refused
#     unless the clone's HEAD is the tag's commit 8a6b06fb880a (the full id
#     below). Installed into build-ucx-cuda/install, where deploy/bundle.sh
#     and tests/gpu/service_gpu.sh pick it up. It puts into CUDA memory over
#     cuda_ipc (1,764 GB/s on the H200 for a 32k-token prompt's KV);
#     docs/operations.md "UCX's own CUDA transports" says why 1.13 does not;
#   - --debian: UCX 1.13.1 from Debian 12's own source package (the version
#     the project's headers and CI use), into build-ucx-cuda/install-1.13.1.
#     Its puts into CUDA memory are emulated through host memory (0.9 GB/s):
#     within one host the project's own CUDA IPC path still goes direct;
#   - --src DIR: any UCX source tree, offline (e.g. a tag exported from a
#     local clone: git -C ucx archive --prefix=ucx-1.22.0/ v1.22.0 | tar -x
#     -C build-ucx-cuda), into build-ucx-cuda/install-<version>.
# Run on the Debian 12 dev machine, as root (apt):
#
#   bash deploy/build_ucx_cuda.sh [--debian | --src DIR] [--fetch-only]
#                                 [--tarball FILE] [PREFIX]
#
# PREFIX (the defaults above, all ignored by git) receives a stripped install
# (bin/ucx_info, lib/libuc{p,s,t,m}.so*, lib/ucx/libuct_cuda.so*, ...) and
# the marker .twain-ucx-cuda-done, which names the version and its source.
# Sources and objects stay in build-ucx-cuda/ (or DIR). --tarball FILE writes
# FILE (.tar.xz) with just bin/ucx_info, lib/libuc*.so* and lib/ucx/*.so*, the
# part a run needs (LD_LIBRARY_PATH=<dir>/lib UCX_MODULE_DIR=<dir>/lib/ucx).
# --fetch-only: clone (or check) the upstream source, verify its commit, print
# its folder and stop (no root, no CUDA needed).
# Releases after 1.13 keep libucp.so.0's ABI: programs built against Debian's
# 1.13 headers run against them.
# Steps (each skipped when already done, so a second run is quick):
#   1. apt: a deb-src entry for bookworm main and a deb entry for non-free
#      (/etc/apt/sources.list.d/twain-ucx-cuda.sources), the build tools (git
#      for the upstream source), and libnvidia-ml-dev + libnvidia-ml1 (nvml.h
#      and libnvidia-ml.so, which configure --with-cuda needs) downloaded and
#      unpacked under build-ucx-cuda/nvml, not installed (libnvidia-ml1 is
#      driver-bound);
#   2. the source: git clone of the tag and its commit checked (default), or
#      apt-get source ucx (--debian: dpkg-source applies the Debian patches);
#   3. ./autogen.sh (neither the tag nor Debian's tarball has a configure
#      script; the upstream one also tries to fetch the gpunetio submodule,
#      which only the device-side GDA-KI and perftest kernels need, left out
#      below: a failed fetch is a warning), configure
#      --with-cuda=/usr/local/cuda --without-java --without-verbs ...;
#      except with --debian also NVCC=/bin/false (no perftest CUDA kernels);
#   4. make -k install: 1.13.1's test/apps/test_cuda_hook.c does not compile
#      against CUDA 13 (cuCtxCreate takes 4 arguments), the libraries are
#      unaffected; the checks afterwards fail the script if a library or the
#      CUDA module is missing;
#   5. strip, check with ucx_info, write the marker, print the libuct_cuda
#      path (last line).
# Every step is bounded (timeout); about 9 minutes of compile on 2 cores for
# 1.22.0, about 2 for 1.13.1.
# Env: TW_UCX_GIT (the repository to clone, default the upstream URL above; a
# local path or file:// URL of a clone with the tag works offline),
# TW_UCX_JOBS (make -j, default 2), TW_UCX_MAKE_TIMEOUT (s, default 2400),
# CUDA_HOME (default /usr/local/cuda).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
work=$here/build-ucx-cuda
cuda=${CUDA_HOME:-/usr/local/cuda}
jobs=${TW_UCX_JOBS:-2}
# the upstream release this script builds by default, and its tag's commit
ucx_release=1.22.0 ucx_tag=v1.22.0 ucx_commit=8a6b06fb880accbb933a79cda893883872c68d9d
ucx_git=${TW_UCX_GIT:-https://github.com/openucx/ucx.git}
debian_version=1.13.1
die() { echo "build_ucx_cuda.sh: $*" >&2; exit 1; }
say() { echo "build_ucx_cuda.sh: $*"; }
abspath() { case $1 in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }
src_arg='' tarball='' prefix='' fetch_only=0 debian=0
while (($#)); do
  case $1 in
    --src) (($# >= 2)) || die "--src needs a folder"; src_arg=$(abspath "$2"); shift 2 ;;
    --debian) debian=1; shift ;;
    --fetch-only) fetch_only=1; shift ;;
    --tarball) (($# >= 2)) || die "--tarball needs a file name"; tarball=$(abspath "$2"); shift 2 ;;
    -h | --help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d;s/^# \{0,1\}//'; exit 0 ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) [ -z "$prefix" ] || die "one PREFIX only"; prefix=$(abspath "$1"); shift ;;
  esac
done
mode=upstream
[ -z "$src_arg" ] || mode=src
if ((debian)); then [ "$mode" = upstream ] || die "--src and --debian exclude each other"; mode=debian; fi
((fetch_only == 0)) || [ "$mode" = upstream ] || die "--fetch-only is for the upstream source (no --src, --debian)"
case $mode in
  src)
    if [ ! -e "$src_arg/configure.ac" ] || [ ! -x "$src_arg/autogen.sh" ]; then
      die "$src_arg is not a UCX source tree (no configure.ac, autogen.sh)"
    fi
    want_version=$(sed -n 's/^define(\[ucx_ver_\(major\|minor\|patch\)\], *\([0-9]*\)).*/\2/p' "$src_arg/configure.ac" | paste -sd.)
    [[ $want_version =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "cannot read the version from $src_arg/configure.ac"
    prefix=${prefix:-$work/install-$want_version}
    origin="source tree $src_arg" ;;
  debian)
    want_version=$debian_version
    prefix=${prefix:-$work/install-$want_version}
    origin="Debian 12 source package ucx $debian_version" ;;
  upstream)
    want_version=$ucx_release
    prefix=${prefix:-$work/install}
    origin="upstream tag $ucx_tag, commit $ucx_commit" ;;
esac

# The upstream source: a shallow clone of the tag, accepted only when its HEAD
# is the tag's known commit (a moved tag or another repository is refused).
# Prints the source folder.
fetch_upstream() {
  local dir=$work/ucx-$ucx_release-git url=$ucx_git head
  command -v git >/dev/null || die "git not found (Debian package git)"
  # a local clone as file:// URL: git ignores --depth for a plain path
  case $url in *://* | *@*:*) ;; *) url=file://$(abspath "$url") ;; esac
  if [ ! -d "$dir/.git" ]; then
    rm -rf "$dir.part"
    mkdir -p "$work"
    say "git clone --depth 1 --branch $ucx_tag $url" >&2
    GIT_TERMINAL_PROMPT=0 timeout 600 git -c advice.detachedHead=false clone -q --depth 1 \
      --branch "$ucx_tag" "$url" "$dir.part" >&2 || die "git clone of $ucx_tag from $url failed (TW_UCX_GIT names another clone; --src DIR builds a tree at hand)"
    mv "$dir.part" "$dir"
  fi
  head=$(git -C "$dir" rev-parse HEAD) || die "$dir is not a git clone: remove it and rerun"
  [ "$head" = "$ucx_commit" ] ||
    die "$dir is at commit $head, not $ucx_tag's $ucx_commit: refusing to build it (remove $dir to clone again)"
  echo "$dir"
}
if ((fetch_only)); then
  dir=$(fetch_upstream)
  say "UCX $ucx_release source in $dir (commit $ucx_commit)"
  echo "$dir"
  exit 0
fi

# --tarball: the run-time part of the install (ucx_info, the libraries, the
# modules), xz-compressed
make_tarball() {
  [ -n "$tarball" ] || return 0
  mkdir -p "$(dirname "$tarball")"
  local files
  mapfile -t files < <(cd "$prefix" && compgen -G 'lib/libuc*.so*'; cd "$prefix" && compgen -G 'lib/ucx/*.so*')
  (cd "$prefix" && tar -cJf "$tarball" bin/ucx_info "${files[@]}") || die "tar of $prefix into $tarball failed"
  say "tarball $tarball ($(du -k "$tarball" | cut -f1) KiB)"
}

marker=$prefix/.twain-ucx-cuda-done # written after strip + checks
installed_version() { # the version PREFIX's ucx_info reports (1.13: "Version", later: "Library version")
  env -u LD_LIBRARY_PATH "$prefix/bin/ucx_info" -v 2>/dev/null | sed -nE 's/^# (Library version:|Version) ([0-9.]+).*/\2/p' | head -1
}
check_install() { # 0 when PREFIX holds a UCX with the CUDA transports
  [ -e "$marker" ] || return 1
  [ -x "$prefix/bin/ucx_info" ] && [ -e "$prefix/lib/libucp.so.0" ] || return 1
  compgen -G "$prefix/lib/ucx/libuct_cuda.so*" >/dev/null || return 1
  env -u LD_LIBRARY_PATH "$prefix/bin/ucx_info" -v 2>/dev/null | grep -q -- "--with-cuda" || return 1
}
cuda_module() { find "$prefix/lib/ucx" -maxdepth 1 -type f -name 'libuct_cuda.so.*' | sort | head -1; }

if check_install; then
  have=$(installed_version)
  # e.g. build-ucx-cuda/install from before 1.22.0 was the default: not kept silently
  [ "$have" = "$want_version" ] ||
    die "$prefix already holds UCX ${have:-of unknown version}, not $want_version: remove it (or name another PREFIX) and rerun"
  desc=$(head -1 "$marker" 2>/dev/null || true)
  say "already installed in $prefix (${desc:-UCX $have})"
  make_tarball
  cuda_module
  exit 0
fi

if [ ! -x "$cuda/bin/nvcc" ] || [ ! -e "$cuda/include/cuda.h" ]; then
  die "no CUDA toolkit at $cuda (set CUDA_HOME)"
fi
if [ "$mode" = debian ] && ! grep -qs '^VERSION_CODENAME=bookworm' /etc/os-release; then
  die "written for Debian 12 (bookworm): its ucx source package is $want_version"
fi

# ---- 1. apt: deb-src + non-free, build dependencies --------------------------------
need_pkgs=(dpkg-dev autoconf automake libtool make pkg-config libnuma-dev)
[ "$mode" != upstream ] || need_pkgs+=(git ca-certificates)
missing_pkgs=()
for p in "${need_pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing_pkgs+=("$p")
done
src_list=/etc/apt/sources.list.d/twain-ucx-cuda.sources
need_src=0
[ "$mode" != debian ] || compgen -G "$work/ucx-$want_version*/" >/dev/null || need_src=1
nvml=$work/nvml/root
nvml_inc=$nvml/usr/include nvml_lib=$nvml/usr/lib/x86_64-linux-gnu/nvidia/current
need_nvml=0
[ -e "$nvml_inc/nvml.h" ] && [ -e "$nvml_lib/libnvidia-ml.so" ] || need_nvml=1
if ((${#missing_pkgs[@]})) || ((need_src)) || ((need_nvml)); then
  [ "$(id -u)" = 0 ] || die "apt steps need root (missing packages: ${missing_pkgs[*]:-none}; source needed: $need_src)"
  if [ ! -e "$src_list" ]; then
    say "adding $src_list (deb-src bookworm main, deb bookworm non-free)"
    cat >"$src_list" <<'EOF'
# added by twain deploy/build_ucx_cuda.sh: the ucx source package and
# libnvidia-ml-dev (nvml.h) for building UCX with CUDA transports
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: non-free
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  fi
  say "apt-get update"
  timeout 300 apt-get update -qq || die "apt-get update failed or took over 300 s"
  if ((${#missing_pkgs[@]})); then
    say "installing ${missing_pkgs[*]}"
    DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq --no-install-recommends \
      "${missing_pkgs[@]}" >/dev/null || die "apt-get install ${missing_pkgs[*]} failed"
  fi
fi
# nvml.h (libnvidia-ml-dev) and libnvidia-ml.so to link against (libnvidia-ml1):
# downloaded and unpacked under build-ucx-cuda/nvml, not installed (libnvidia-ml1
# is part of the NVIDIA driver, which this machine has not got and which apt
# cannot install beside it). At run time the GPU machine's driver provides
# libnvidia-ml.so.1; the bundle does not carry it.
if ((need_nvml)); then
  mkdir -p "$nvml"
  say "apt-get download libnvidia-ml-dev libnvidia-ml1 (unpacked in $nvml, not installed)"
  rm -f "$work"/nvml/*.deb
  (cd "$work/nvml" && timeout 300 apt-get download -qq libnvidia-ml-dev libnvidia-ml1 2>&1 |
    grep -v 'unsandboxed' >&2) || true
  for d in "$work"/nvml/libnvidia-ml-dev_*.deb "$work"/nvml/libnvidia-ml1_*.deb; do
    [ -e "$d" ] || die "apt-get download libnvidia-ml-dev libnvidia-ml1 failed (Debian non-free in $src_list?)"
    dpkg-deb -x "$d" "$nvml"
  done
fi
[ -e "$nvml_inc/nvml.h" ] || die "nvml.h not in $nvml_inc (libnvidia-ml-dev)"
[ -e "$nvml_lib/libnvidia-ml.so" ] || die "libnvidia-ml.so not in $nvml_lib (libnvidia-ml1)"

# ---- 2. the source: the upstream tag's clone, --src, or Debian's source package -----
mkdir -p "$work"
logs=$work/logs-$want_version # autogen, configure and make logs
mkdir -p "$logs"
if [ "$mode" = upstream ]; then
  src=$(fetch_upstream)
  say "UCX $ucx_release source in $src (commit $ucx_commit)"
elif [ "$mode" = src ]; then
  src=$src_arg
else
# Debian patches applied by dpkg-source
if ((need_src)); then
  say "apt-get source ucx in $work"
  (cd "$work" && timeout 300 apt-get source -qq ucx >"$work/source.log" 2>&1) ||
    { tail -20 "$work/source.log" >&2; die "apt-get source ucx failed (log $work/source.log)"; }
fi
src=$(find "$work" -maxdepth 1 -type d -name "ucx-$want_version*" | sort | head -1)
[ -n "$src" ] || die "no ucx-$want_version source folder in $work (apt-get source gave: $(ls "$work"))"
if [ -e "$src/debian/patches/series" ] && [ ! -d "$src/.pc" ]; then
  die "$src has Debian patches but none applied (.pc missing): remove $src and rerun"
fi
fi

# ---- 3. autogen + configure ---------------------------------------------------------
cd "$src"
if [ ! -x configure ]; then
  say "./autogen.sh"
  # GIT_TERMINAL_PROMPT=0: the gpunetio submodule's fetch fails at once
  # offline instead of asking for credentials
  GIT_TERMINAL_PROMPT=0 timeout 300 ./autogen.sh >"$logs/autogen.log" 2>&1 || { tail -20 "$logs/autogen.log" >&2; die "autogen.sh failed"; }
fi
conf=(CPPFLAGS="-I$nvml_inc" LDFLAGS="-L$nvml_lib" --prefix="$prefix" --with-cuda="$cuda" --without-java --without-go
  --without-verbs --without-rdmacm --without-rocm --without-gdrcopy --without-knem --without-xpmem
  --without-ugni --disable-doxygen-doc --enable-mt --disable-debug --disable-assertions)
# newer releases compile the perftest CUDA kernels with nvcc; they include
# the device API's headers, which need the gpunetio submodule that an
# exported tag lacks (and a clone only has when autogen.sh could fetch it).
# The transports need no nvcc: NVCC=/bin/false makes configure's nvcc version
# check fail, so those kernels are left out.
[ "$mode" = debian ] || conf+=(NVCC=/bin/false --without-ze --without-fuse3 --without-mad --without-efa
  --without-mlx5 --disable-examples --disable-test-apps)
# configure again when its arguments changed
if [ ! -e config.status ] || [ "$(cat "$logs/configure.args" 2>/dev/null)" != "${conf[*]}" ]; then
  say "configure ${conf[*]}"
  timeout 600 ./configure "${conf[@]}" >"$logs/configure.log" 2>&1 ||
    { tail -30 "$logs/configure.log" >&2; die "configure failed (log $logs/configure.log)"; }
  printf '%s' "${conf[*]}" >"$logs/configure.args"
fi
grep -q '^#define HAVE_CUDA 1' config.h 2>/dev/null ||
  die "configure did not enable CUDA (see 'checking for cuda' in $logs/configure.log)"

# ---- 4. make -k install --------------------------------------------------------------
say "make -k -j$jobs install (log $logs/make.log)"
if ! timeout "${TW_UCX_MAKE_TIMEOUT:-2400}" make -k -j"$jobs" install >"$logs/make.log" 2>&1; then
  say "make reported errors (expected with 1.13.1: test/apps/test_cuda_hook.c under CUDA 13); first ones:"
  grep -E ': (fatal )?error:' "$logs/make.log" | sort -u | head -5 | sed 's/^/  /'
fi

# ---- 5. strip + check ----------------------------------------------------------------
for f in "$prefix"/bin/* "$prefix"/lib/*.so.*.*.* "$prefix"/lib/ucx/*.so.*.*.*; do
  [ -f "$f" ] && [ ! -L "$f" ] && head -c4 "$f" | grep -q ELF && strip --strip-unneeded "$f"
done
rm -f "$prefix"/lib/*.la "$prefix"/lib/ucx/*.la "$prefix"/lib/*.a "$prefix"/lib/ucx/*.a
printf 'UCX %s (%s)\nversion=%s\n' "$want_version" "$origin" "$want_version" >"$marker"
check_install || die "install in $prefix is incomplete (ucx_info, libucp.so.0 or lib/ucx/libuct_cuda.so* missing, or no --with-cuda): see $logs/make.log"
have=$(installed_version)
[ "$have" = "$want_version" ] || die "the install in $prefix reports UCX ${have:-of unknown version}, not $want_version"
say "installed in $prefix: $(head -1 "$marker"), $(du -sh "$prefix/lib" | cut -f1) lib, stripped"
make_tarball
cuda_module
