#!/usr/bin/env bash
# GPU call L (2026-12-06c): the final code's GPU tests (cuBLASLt GEMM with the K rule, the Triton kernels
# incl. the bf16 MoE and the activation quantiser, compiled).
set -u
R=/tmp/rL; mkdir -p $R; OUT0=$OUT
pack() { tar czf $OUT0/r.tgz -C /tmp rL; }
python3 -m pip install --no-deps .whl/jax_triton-0.3.1-py3-none-any.whl > $R/pip.txt 2>&1
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
run() { local name=$1 t=$2; shift 2; timeout $t "$@" > $R/$name.txt 2>&1; echo "$name rc=$?"; pack; }
run build 40 bash ffi/cuda/build.sh
run pytest 60 env JAX_PLATFORMS=cuda python3 -m pytest -q -n0 -p no:cacheprovider tests/test_cublaslt_fp8_gemm.py tests/test_triton_fp8.py
