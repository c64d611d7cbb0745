#!/usr/bin/env bash
# GPU calls (2026-12-07c, issue 40). Runs from gpusnap/ (a snapshot of the tree): bash benchmarks/2026-12-07c/gpu1.sh PHASE
# a: the CUDA-only tests; MLA decode device-timed (roofline.time_device) at 128 and 16 heads, 1 row;
#    a profile of the speculative step (MTP k=1, 2 layers, B=197, FP8 KV) against the plain one.
# b: bench_spec_decode with the overlapped speculative loop against the synchronous one, at depth (2 and 4 layers).
set -u
PH=${1:-a}
R=/tmp/r; mkdir -p $R; OUT0=$OUT
pack() { tar czf $OUT0/r.tgz -C /tmp r; }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total,driver_version --format=csv > $R/gpu.txt
python3 -m pip install --no-deps ../.whl/jax_triton-0.3.1-py3-none-any.whl > $R/pip.txt 2>&1
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
run() { local name=$1 t=$2; shift 2; local s=$SECONDS; timeout $t "$@" > $R/$name.txt 2>&1; echo "$name rc=$? $((SECONDS-s))s" | tee -a $R/log.txt; pack; }
[ -f ffi/cuda/build/libmoejax_fp8_gemm.so ] || run build 120 bash ffi/cuda/build.sh
P="python3 scripts/profile_step.py --preset deepseek-v3-ep8-rank --layers 2 --concurrency 197 --input-len 2000 --kv-dtype fp8 --kernels auto --steps 5 --top 30"
if [ "$PH" = a ]; then
run pytest 150 env JAX_PLATFORMS=cuda python3 -m pytest -q -n0 -p no:cacheprovider -o addopts="" \
  tests/test_cublaslt_fp8_gemm.py tests/test_triton_mla_decode.py tests/test_triton_fp8.py tests/test_kernel_plans.py
run mla128_dev 120 python3 scripts/bench_kernels.py --only mla --batch 16 64 197 512 --context 2048 8192 --heads 128 --kv bf16 fp8
run mla16_dev 70 python3 scripts/bench_kernels.py --only mla --batch 16 64 256 --context 2048 --heads 16 --kv bf16 fp8
run prof_k1 100 $P --speculative-tokens 1 --json $R/prof_k1.json
run prof_k0 80 $P --json $R/prof_k0.json
fi
if [ "$PH" = b ]; then
run spec 420 python3 scripts/bench_spec_decode.py --preset deepseek-v3-ep8-rank --layers 2,4 --batch 16,64,197 --k 0,1 --input-len 2000 --kv-dtype fp8 --scheduling async,sync --steps 8 --json $R/spec.json
fi
if [ "$PH" = c ]; then  # the routed experts' tiles at the rows an expert of B=197 plain (49), its k=1 verify (98), B=394 (197)
G='{"block_m":[32,64,128],"block_n":[64,128],"block_k":[64,128],"num_warps":[4,8],"num_stages":[3]}'
run moe_sweep 420 python3 scripts/bench_kernels.py --only moe --moe-shapes v3-ep8 --tokens 49 98 197 --sweep --grid "$G"
fi
if [ "$PH" = d ]; then  # the speculative rows again with the 64-row MoE tile (33-64 rows an expert)
run spec2 300 python3 scripts/bench_spec_decode.py --preset deepseek-v3-ep8-rank --layers 2,4 --batch 197 --k 0,1 --input-len 2000 --kv-dtype fp8 --steps 8 --json $R/spec2.json
fi
