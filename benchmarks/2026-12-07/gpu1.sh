#!/usr/bin/env bash
# GPU call 1 (2026-12-07, issue 40). Runs from gpusnap/ (a snapshot of the tree).
# The CUDA-only tests in their final form; the 512 x 2048 FP8 step with dense W8A8 on Pallas vs cuBLASLt,
# twice each, alternating; the V2-Lite 256 x 2000 step; MLA decode at the grid.
set -u
PH=${1:-all}
R=/tmp/r1; mkdir -p $R; OUT0=$OUT
pack() { tar czf $OUT0/r.tgz -C /tmp r1; }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total,driver_version --format=csv > $R/gpu.txt
python3 -m pip install --no-deps ../.whl/jax_triton-0.3.1-py3-none-any.whl > $R/pip.txt 2>&1
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
run() { local name=$1 t=$2; shift 2; local s=$SECONDS; timeout $t "$@" > $R/$name.txt 2>&1; echo "$name rc=$? $((SECONDS-s))s" | tee -a $R/log.txt; pack; }
[ -f ffi/cuda/build/libmoejax_fp8_gemm.so ] || run build 120 bash ffi/cuda/build.sh
if [ "$PH" = all ] || [ "$PH" = a ]; then
run pytest 240 env JAX_PLATFORMS=cuda python3 -m pytest -q -n0 -p no:cacheprovider -o addopts="" \
  tests/test_cublaslt_fp8_gemm.py tests/test_triton_mla_decode.py tests/test_triton_fp8.py
B="python3 scripts/bench_decode.py --preset deepseek-v3-ep8-rank --layers 4 --concurrency 512 --input-len 2048 --fill random --kernels auto --weight-dtype fp8 --steps 20"
for i in 1 2; do
run step_pallas$i 150 env MOEJAX_W8A8_DENSE_KERNEL=pallas $B --json $R/step_pallas$i.json
run step_cublaslt$i 150 env MOEJAX_W8A8_DENSE_KERNEL=cublaslt $B --json $R/step_cublaslt$i.json
done
fi
if [ "$PH" = all ] || [ "$PH" = b ]; then
run v2lite 200 python3 scripts/bench_decode.py --preset deepseek-v2-lite --concurrency 256 --input-len 2000 --fill random --kernels auto --weight-dtype bf16 --steps 20 --json $R/v2lite.json
G='[{"kernel":["triton"],"block_n":[32,64],"num_stages":[1,2,3]},{"kernel":["pallas"]}]'
run mla128s 240 python3 scripts/bench_kernels.py --only mla --batch 197 512 --context 2048 --heads 128 --kv bf16 fp8 --sweep --sweep-kv bf16 fp8 --grid "$G"
run mla16s 120 python3 scripts/bench_kernels.py --only mla --batch 256 --context 2048 --heads 16 --kv bf16 fp8 --sweep --sweep-kv bf16 fp8 --grid "$G"
fi
if [ "$PH" = all ] || [ "$PH" = c ]; then
run mla128 300 python3 scripts/bench_kernels.py --only mla --batch 16 64 197 512 --context 2048 8192 --heads 128 --kv bf16 fp8
run mla16 200 python3 scripts/bench_kernels.py --only mla --batch 16 64 256 --context 2048 8192 --heads 16 --kv bf16 fp8
fi
