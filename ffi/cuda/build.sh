#!/usr/bin/env bash
# Builds libmoejax_fp8_gemm.so (cuBLASLt's block-scaled FP8 GEMM as an XLA FFI target) into $1 (default: this
# directory's build/). Needs a C++17 compiler, jaxlib's XLA FFI headers, and CUDA's runtime and cuBLAS (12.9+)
# headers and libraries: a CUDA toolkit (CUDA_HOME, /usr/local/cuda) or the nvidia-* wheels jax[cuda13] installs.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${1:-$HERE/build}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
read -r FFI_INC CUDA_INC BLAS_INC CUDA_LIB BLAS_LIB < <("$PY" - <<'PYEOF'
import glob, os, site, sys
import jax
roots = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"] + [os.path.join(p, "nvidia") for p in site.getsitepackages()]
def find(pattern):
    for r in roots:
        if r:
            hits = sorted(glob.glob(os.path.join(r, pattern), recursive=True))
            if hits:
                return os.path.dirname(hits[0])
    sys.exit(f"build.sh: {pattern} not found under {roots}")
print(jax.ffi.include_dir(), find("**/include/cuda_runtime_api.h"), find("**/include/cublasLt.h"),
      find("**/lib*/libcudart.so*"), find("**/lib*/libcublasLt.so*"))
PYEOF
)
lib() { ls "$1"/$2.so* | head -1; }
set -x
${CXX:-g++} -std=c++17 -O2 -fPIC -shared "$HERE/fp8_block_gemm.cc" -o "$OUT/libmoejax_fp8_gemm.so" \
  -isystem "$FFI_INC" -isystem "$CUDA_INC" -isystem "$BLAS_INC" \
  "$(lib "$BLAS_LIB" libcublasLt)" "$(lib "$CUDA_LIB" libcudart)" -Wl,-rpath,"$BLAS_LIB" -Wl,-rpath,"$CUDA_LIB"
