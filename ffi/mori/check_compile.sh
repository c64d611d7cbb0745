#!/usr/bin/env bash
# Compile check of the MoRI implementation on a machine without ROCm 6+ or a GPU (docs/ffi.md,
# "What was run"): against MoRI's own headers and libraries from the amd-mori wheel, with
# Debian 12's ROCm 5.2 toolchain (apt-get install hipcc libamdhip64-dev librocm-smi-dev
# libibverbs-dev libhsakmt-dev).
#   1. layout_kernels.hip: compiled for real by hipcc to AMD GPU code (gfx90a, gfx940);
#   2. ep_mori.cc: compiled by clang++ as host C++ against MoRI's headers, with check-only shims for
#      what ROCm 5.2 lacks (ROCm 6.2's hipDataType values; hsakmt/ include paths);
#   3. linked into a shared library, and every MoRI symbol it needs found, by its mangled signature,
#      in the wheel's libmori_ops.so / libmori_shmem.so (so the calls match the shipped ABI).
# Nothing is run: that needs AMD GPUs. Usage: check_compile.sh MORI_DIR [XLA_FFI_INCLUDE_DIR]
#   MORI_DIR: the wheel's mori/ directory (pip download amd-mori==1.0.0 --python-version 3.12
#   --only-binary=:all: --no-deps, then unzip).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
mori="${1:?usage: $0 MORI_DIR [XLA_FFI_INCLUDE_DIR]}"
xla="${2:-$(python -c 'import jax; print(jax.ffi.include_dir())')}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
export HIP_PLATFORM=amd HIP_COMPILER=clang  # Debian's hipcc picks nvcc where CUDA is installed

mkdir -p "$out/shim/hip" "$out/shim/hsakmt"
cat > "$out/shim/hip/library_types.h" <<'H'
#pragma once  // check-only: ROCm 6.2's hipDataType, which ROCm 5.2 lacks (no bf16 / fp8 members)
typedef enum hipDataType {
  HIP_R_32F = 0, HIP_R_64F = 1, HIP_R_16F = 2, HIP_R_8I = 3, HIP_C_32F = 4, HIP_C_64F = 5, HIP_C_16F = 6,
  HIP_C_8I = 7, HIP_R_8U = 8, HIP_C_8U = 9, HIP_R_32I = 10, HIP_C_32I = 11, HIP_R_32U = 12, HIP_C_32U = 13,
  HIP_R_16BF = 14, HIP_C_16BF = 15, HIP_R_8F_E4M3 = 28, HIP_R_8F_E5M2 = 29, HIP_R_8F_E4M3_FNUZ = 1000,
  HIP_R_8F_E5M2_FNUZ = 1001,
} hipDataType;
typedef enum hipLibraryPropertyType { HIP_LIBRARY_MAJOR_VERSION, HIP_LIBRARY_MINOR_VERSION, HIP_LIBRARY_PATCH_LEVEL } hipLibraryPropertyType;
H
echo '#include <hsakmt.h>' > "$out/shim/hsakmt/hsakmt.h"
echo '#include <hsakmttypes.h>' > "$out/shim/hsakmt/hsakmttypes.h"

# MI250 (gfx90a) and MI300 (gfx940: ROCm 5.2's clang predates gfx942's name)
hipcc -std=c++17 --offload-arch=gfx90a --offload-arch=gfx940 -fPIC -c "$here/layout_kernels.hip" \
  -o "$out/layout_kernels.o" 2> "$out/hipcc.log" || { cat "$out/hipcc.log"; exit 1; }
objdump -h "$out/layout_kernels.o" | grep -q hip_fatbin || { echo "no GPU code in layout_kernels.o"; exit 1; }
echo "layout_kernels.hip: compiled for gfx90a and gfx940"

clang++-15 -std=c++20 -fPIC -O1 -Wall -Wextra -c -D__HIP_PLATFORM_AMD__ -I "$out/shim" -isystem "$xla" \
  -isystem "$mori/_jit_sources/include" "$here/ep_mori.cc" -o "$out/ep_mori.o"
echo "ep_mori.cc: compiled against $mori/_jit_sources/include"

clang++-15 -shared -o "$out/libmoejax_ep_mori.so" "$out/ep_mori.o" "$out/layout_kernels.o" \
  -L"$mori" -lmori_ops -lmori_shmem -lmori_application -lamdhip64
nm -D --defined-only "$mori"/libmori_*.so | awk 'NF == 3 {print $3}' | sort -u > "$out/exported"
missing=0
for sym in $(nm -D --undefined-only "$out/libmoejax_ep_mori.so" | awk '{print $2}' | grep mori); do
  if ! grep -qx "$sym" "$out/exported"; then echo "MISSING in the wheel: $sym"; missing=1; fi
done
[ "$missing" = 0 ] && echo "linked; every MoRI symbol it calls is exported by the wheel's libraries:" \
  && nm -D --undefined-only "$out/libmoejax_ep_mori.so" | awk '{print $2}' | grep mori | c++filt | sed 's/^/  /'
echo "exported: $(nm -D --defined-only "$out/libmoejax_ep_mori.so" | awk '/ T Moejax/{print $3}' | tr '\n' ' ')"
exit "$missing"
