#!/usr/bin/env bash
# GPU calls (2026-12-07d, issue 40). From gpusnap/ (a snapshot of HEAD): bash benchmarks/2026-12-07d/gpu1.sh PHASE
# a: the Pallas MLA kernel with plain (unmasked, unselected) FP8 loads against the Triton kernel and XLA,
#    tile sweeps at 16 heads (FP8) and 128 heads (bf16, FP8); the kernel tests on the GPU.
set -u
PH=${1:-a}
R=/tmp/r; mkdir -p $R; OUT0=$OUT
pack() { tar czf $OUT0/r.tgz -C /tmp r; }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total,driver_version --format=csv > $R/gpu.txt
python3 -m pip install --no-deps ../.whl/jax_triton-0.3.1-py3-none-any.whl > $R/pip.txt 2>&1
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
run() { local name=$1 t=$2; shift 2; local s=$SECONDS; timeout $t "$@" > $R/$name.txt 2>&1; echo "$name rc=$? $((SECONDS-s))s" | tee -a $R/log.txt; pack; }
G16='[{"kernel":["pallas"],"tile":["gather"],"block_h":[16],"block_t":[32,64,128],"num_warps":[4],"num_stages":[2,3]},
 {"kernel":["pallas"],"tile":["pages"],"block_h":[16],"block_t":[16,32,64],"num_warps":[4],"num_stages":[2,3]}]'
G128='[{"kernel":["pallas"],"tile":["gather"],"block_h":[16,32],"block_t":[32,64],"num_warps":[4],"num_stages":[2,3]},
 {"kernel":["pallas"],"tile":["gather"],"block_h":[64],"block_t":[32,64],"num_warps":[8],"num_stages":[2,3]},
 {"kernel":["pallas"],"tile":["pages"],"block_h":[32],"block_t":[16,32],"num_warps":[4],"num_stages":[2,3]}]'
if [ "$PH" = a ]; then
run mla16 150 python3 scripts/bench_kernels.py --only mla --batch 64 256 --context 2048 --heads 16 --kv fp8 bf16 --sweep --sweep-kv fp8 --grid "$G16"
run mla128 330 python3 scripts/bench_kernels.py --only mla --batch 197 512 --context 2048 --heads 128 --kv fp8 bf16 --sweep --sweep-kv fp8 bf16 --grid "$G128"
run pytest 100 env JAX_PLATFORMS=cuda python3 -m pytest -q -n0 -p no:cacheprovider -o addopts="" tests/test_kernels.py -k "mla_decode_matches or mfa_decode_kernel or xla_path_reads"
fi
# b, c: a cached restart with the executable set loaded in a thread pool (8: the compile threads) against one
#    by one (MOEJAX_COMPILE_THREADS=1), V2-Lite (RANDOM weights) at a smaller set than the c1024 one so the
#    cold start that fills the caches fits the call: b at --max-num-seqs 64 / --max-prefill-tokens 2048 (then
#    MLA 16 heads FP8 as now selected, Pallas gather, against Triton), c at 16 / 1024 / --max-model-len 1024.
restarts() {  # cold-start timeout, cached timeout, server flags
  local tc=$1 tw=$2; shift 2
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../.whl/*.whl >> $R/pip.txt 2>&1
  export PYTHONPATH=/tmp/site:$PWD XLA_FLAGS=--xla_disable_hlo_passes=rematerialization
  run start_pool $((tc + 30)) python3 scripts/bench_startup.py --runs 2 --cache-dir /tmp/bs --log-dir $R/bs_pool --json $R/bs_pool.json --timeout $tc -- "$@"
  run start_serial $((tw + 5)) env MOEJAX_COMPILE_THREADS=1 python3 scripts/bench_startup.py --runs 1 --cache-dir /tmp/bs --log-dir $R/bs_serial --json $R/bs_serial.json --timeout $tw -- "$@"
}
V2="--model deepseek-v2-lite --load-format dummy --kv-cache-dtype fp8"
if [ "$PH" = b ]; then
restarts 300 90 $V2 --max-num-seqs 64 --max-model-len 2176 --max-prefill-tokens 2048
run mla16 60 python3 scripts/bench_kernels.py --only mla --batch 64 256 --context 2048 --heads 16 --kv fp8
run mla16_tri 60 env MOEJAX_MLA_KERNEL=triton python3 scripts/bench_kernels.py --only mla --batch 64 256 --context 2048 --heads 16 --kv fp8
fi
[ "$PH" = c ] && restarts 180 55 $V2 --max-num-seqs 16 --max-model-len 1024 --max-prefill-tokens 1024
# d: where a cold start's time goes: the V2-Lite decode program (B=256, FP8 KV) built again at 2 and 4 layers
#    with the kernels (auto) and without (xla): trace + lower and XLA seconds, its custom calls (per layer
#    cost = the difference; the kernels' share = auto - xla).
if [ "$PH" = d ]; then
for L in 2 4; do for K in auto xla; do
run compile_${L}_$K 150 python3 scripts/bench_decode.py --preset deepseek-v2-lite --layers $L --concurrency 256 --input-len 2000 --output-len 16 --steps 3 --warmup 1 --fill random --kv-dtype fp8 --kernels $K --compile-time
done; done
fi
