#!/usr/bin/env bash
# GPU call 1 (2026-12-07b, issue 40). Runs from gpusnap/ (a snapshot of the tree).
# a: CUDA kernel tests; the 512 x 2048 FP8 step on the new default (cuBLASLt for the dense W8A8) vs Pallas;
# b: MLA decode at the grid (16/64/197/512 x 2048/8192, 1/2/4 query rows), 128 and 16 heads;
# c: MTP at depth: 2 and 4 layers, batch 16/64/197, k 0/1/2, fit and projection to 61 layers.
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
run pytest 200 env JAX_PLATFORMS=cuda python3 -m pytest -q -n0 -p no:cacheprovider -o addopts="" \
  tests/test_cublaslt_fp8_gemm.py tests/test_triton_mla_decode.py tests/test_triton_fp8.py tests/test_kernel_plans.py
B="python3 scripts/bench_decode.py --preset deepseek-v3-ep8-rank --layers 4 --concurrency 512 --input-len 2048 --fill random --kernels auto --weight-dtype fp8 --steps 20"
run step_auto1 150 $B --json $R/step_auto1.json
run step_pallas1 150 env MOEJAX_W8A8_DENSE_KERNEL=pallas $B --json $R/step_pallas1.json
run step_auto2 150 $B --json $R/step_auto2.json
fi
if [ "$PH" = all ] || [ "$PH" = b ]; then
run mla128 240 python3 scripts/bench_kernels.py --only mla --batch 16 64 197 512 --context 2048 8192 --heads 128 --kv bf16 fp8 --rows 2 4
run mla16 150 python3 scripts/bench_kernels.py --only mla --batch 16 64 256 --context 2048 8192 --heads 16 --kv bf16 fp8 --rows 2 4
fi
if [ "$PH" = all ] || [ "$PH" = c ]; then
run spec 300 python3 scripts/bench_spec_decode.py --preset deepseek-v3-ep8-rank --layers 2,4 --batch 16,64,197 --k 0,1,2 --input-len 2000 --kv-dtype fp8 --json $R/spec.json
fi
if [ "$PH" = probe1 ] || [ "$PH" = probe2 ]; then
S=$([ "$PH" = probe1 ] && echo 512x2048 || echo "64x8192 197x2048")
run $PH 280 python3 benchmarks/2026-12-07b/mla_probe.py $S $R/$PH.json
fi
if [ "$PH" = d ]; then
run mla128_1row 200 python3 scripts/bench_kernels.py --only mla --batch 16 64 197 512 --context 2048 8192 --heads 128 --kv bf16 fp8
run probe3 200 python3 benchmarks/2026-12-07b/mla_probe.py 512x2048 --warps16 $R/probe3.json
run mla16_1row 120 python3 scripts/bench_kernels.py --only mla --batch 16 64 256 --context 2048 8192 --heads 16 --kv bf16 fp8
fi
if [ "$PH" = e ]; then  # device-timed (roofline.time_device) from here
run mla128_dev 150 python3 scripts/bench_kernels.py --only mla --batch 16 64 197 512 --context 2048 8192 --heads 128 --kv bf16 fp8
run mla16_dev 90 python3 scripts/bench_kernels.py --only mla --batch 16 64 256 --context 2048 8192 --heads 16 --kv bf16 fp8
run rows_dev 100 python3 scripts/bench_kernels.py --only mla --batch 16 64 256 --context 2048 --heads 128 16 --kv fp8 --rows 2 4
fi
if [ "$PH" = f ]; then  # the shortest device-timed grid (the budget's end)
run mla128_dev 100 python3 scripts/bench_kernels.py --only mla --batch 16 64 197 512 --context 2048 --heads 128 --kv bf16 fp8
run mla16_dev 60 python3 scripts/bench_kernels.py --only mla --batch 16 64 256 --context 2048 --heads 16 --kv bf16 fp8
fi
