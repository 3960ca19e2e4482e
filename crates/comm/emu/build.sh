#!/usr/bin/env bash
# Builds kiln's CUDA driver and NCCL emulators into DIR (libcuda.so, libnccl.so): put DIR on
# LD_LIBRARY_PATH and kiln's `nccl` feature runs across processes without a GPU. See README.md.
#
#     bash crates/comm/emu/build.sh DIR
set -euo pipefail
dir=${1:?usage: build.sh DIR}
src=$(cd "$(dirname "$0")" && pwd)
cc=${CC:-cc}
mkdir -p "$dir"
"$cc" -shared -fPIC -O2 -Wall -Wextra -Werror -pthread -o "$dir/libcuda.so" "$src/cuda.c"
# libnccl.so finds the emulated libcuda.so beside it (the one cudarc has loaded).
"$cc" -shared -fPIC -O2 -Wall -Wextra -Werror -pthread -o "$dir/libnccl.so" "$src/nccl.c" \
  -L"$dir" -lcuda -Wl,-rpath,'$ORIGIN'
