#!/usr/bin/env bash
# Builds libmoejax_fp8_gemm.so (cuBLASLt's block-scaled FP8 GEMM as an XLA FFI target) into $1 (default: this
# directory's build/). `pip install` runs it (setup.py) and so can a user after installing. Needs a C++17
# compiler, XLA's FFI headers ($XLA_FFI_INCLUDE_DIR, else jax.ffi.include_dir()), and CUDA's runtime and
# cuBLAS 12.9+ headers and libraries: a CUDA toolkit (CUDA_HOME, /usr/local/cuda) or the nvidia-* wheels
# jax[cuda13] installs. Exit 3: no CUDA / cuBLAS 12.9+ found (nothing to build here); other failures exit 1.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${1:-$HERE/build}
PY=${PYTHON:-python3}
FOUND=$("$PY" - <<'PYEOF'
import glob, os, site, sys
roots = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"] + [os.path.join(p, "nvidia") for p in site.getsitepackages()]
def find(pattern):
    for r in roots:
        if r:
            hits = sorted(glob.glob(os.path.join(r, pattern), recursive=True))
            if hits:
                return hits[0]
    print(f"build.sh: {pattern} not found under {[r for r in roots if r]}", file=sys.stderr)
    sys.exit(3)
blas_h = find("**/include/cublasLt.h")
with open(blas_h) as f:  # the block-scaled modes came with cuBLAS 12.9
    if "CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F" not in f.read():
        print(f"build.sh: {blas_h} predates cuBLAS 12.9 (no 128x128 block scaling)", file=sys.stderr)
        sys.exit(3)
ffi = os.environ.get("XLA_FFI_INCLUDE_DIR")
if not ffi:
    import jax
    ffi = jax.ffi.include_dir()
print(ffi, *(os.path.dirname(find(p)) for p in ("**/include/cuda_runtime_api.h", "**/lib*/libcudart.so*",
                                                 "**/lib*/libcublasLt.so*")), os.path.dirname(blas_h))
PYEOF
) || exit $?
read -r FFI_INC CUDA_INC CUDA_LIB BLAS_LIB BLAS_INC <<<"$FOUND"
lib() { ls "$1"/$2.so* | head -1; }
mkdir -p "$OUT"
set -x
${CXX:-g++} -std=c++17 -O2 -fPIC -shared "$HERE/fp8_block_gemm.cc" -o "$OUT/libmoejax_fp8_gemm.so" \
  -isystem "$FFI_INC" -isystem "$CUDA_INC" -isystem "$BLAS_INC" \
  "$(lib "$BLAS_LIB" libcublasLt)" "$(lib "$CUDA_LIB" libcudart)" -Wl,-rpath,"$BLAS_LIB" -Wl,-rpath,"$CUDA_LIB"
