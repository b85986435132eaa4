#!/usr/bin/env bash
# Builds the CUDA simulator: one shared object, installed under the names cudarc loads (libcuda,
# libnvrtc, libcublas, libnccl) in target/cudasim/lib. Needs only a C++17 compiler (CXX, default c++).
# `cudasim/run CMD` builds it when its sources changed and runs CMD over it.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out="${CUDASIM_LIB_DIR:-$here/../target/cudasim/lib}"
mkdir -p "$out"
cxx="${CXX:-c++}"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# The kernel-side headers travel inside the library: the simulated NVRTC writes them next to each
# program it compiles.
{
    echo 'extern const char cudasim_abi_h[] = R"cudasim_header('
    cat "$here/src/abi.h"
    echo ')cudasim_header";'
    echo 'extern const char cudasim_device_h[] = R"cudasim_header('
    cat "$here/src/device.h"
    echo ')cudasim_header";'
} > "$tmp/embedded.cpp"

"$cxx" -std=c++17 -O2 -g -fPIC -shared -Wall -Wextra -Werror -Wno-unused-parameter \
    -fvisibility=default -Wl,-soname,libcudasim.so \
    -I"$here/src" "$here"/src/*.cpp "$tmp/embedded.cpp" -ldl -lpthread \
    -o "$out/libcudasim.so.tmp"
mv "$out/libcudasim.so.tmp" "$out/libcudasim.so"
for name in libcuda.so libcuda.so.1 libnvrtc.so libcublas.so libcublasLt.so libnccl.so libnccl.so.2; do
    ln -sf libcudasim.so "$out/$name"
done
echo "cudasim: built $out/libcudasim.so"
