#!/usr/bin/env bash
# GPU calls (2026-12-07f). From gpusnap/ (a snapshot of HEAD): bash benchmarks/2026-12-07f/gpu1.sh PHASE
set -u
PH=${1:-a}
R=/tmp/r; mkdir -p $R; OUT0=$OUT
pack() { tar czf $OUT0/r.tgz -C /tmp r; }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total,driver_version --format=csv > $R/gpu.txt
python3 -m pip install --no-deps ../.whl/jax_triton-0.3.1-py3-none-any.whl > $R/pip.txt 2>&1
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
run() { local name=$1 t=$2; shift 2; local s=$SECONDS; timeout $t "$@" > $R/$name.txt 2>&1; echo "$name rc=$? $((SECONDS-s))s" | tee -a $R/log.txt; pack; }
# a: Mosaic GPU's API on the device's jax and its FA3 example's rate; where a V2-Lite decode program's cold
#    build goes (2 and 4 layers, kernels auto vs xla: per-layer cost and the kernels' share).
if [ "$PH" = a ]; then
run probe 120 python3 benchmarks/2026-12-07f/mgpu_probe.py
for LK in 2:auto 2:xla 4:auto; do L=${LK%:*}; K=${LK#*:}
run compile_${L}_$K 130 python3 scripts/bench_decode.py --preset deepseek-v2-lite --layers $L --concurrency 256 --input-len 2000 --output-len 16 --steps 3 --warmup 1 --fill random --kv-dtype fp8 --kernels $K --compile-time
done
fi
# b: the Mosaic GPU MLA kernel: its tests compiled on the card, then 128 heads x 197 / 512 x 2048, bf16 and FP8,
#    against the kernels selected before it (bf16: Pallas gather 32 heads x 64 tokens; FP8: Triton), and XLA,
#    in one run (the "selected" row is now mgpu with its own splits).
GM='[{"tile":["gather"],"block_h":[32],"block_t":[64],"num_warps":[4],"num_stages":[3]},{"kernel":["triton"]},{"kernel":["mgpu"],"block_t":[64],"num_stages":[2],"num_splits":[1,2]}]'
if [ "$PH" = b ]; then
run pytest 100 env JAX_PLATFORMS=cuda python3 -m pytest -q -n0 -p no:cacheprovider -o addopts="" tests/test_mgpu_mla_decode.py
run mla128 150 python3 scripts/bench_kernels.py --only mla --batch 197 512 --context 2048 --heads 128 --kv bf16 fp8 --sweep --sweep-kv bf16 fp8 --grid "$GM"
for K in mgpu pallas; do  # the node's step (FP8 weights, bf16 cache), MLA on the new kernel and on the one selected before
run step_$K 130 env MOEJAX_MLA_KERNEL=$K python3 scripts/bench_decode.py --preset deepseek-v3-ep8-rank --layers 4 --concurrency 512 --input-len 2048 --fill random --kernels auto --weight-dtype fp8 --steps 10
done
fi
# c: the selection's other points: 128 heads x 16 / 64 sequences x 2048 / 8192 (bf16; mgpu with its own splits
#    against the kernels selected before), and the node's step at 197 sequences (what fits 8x H200).
GC='[{"tile":["gather"],"block_h":[32],"block_t":[64],"num_warps":[4],"num_stages":[3]},{"kernel":["triton"]},{"kernel":["mgpu"],"block_t":[64],"num_stages":[2],"num_splits":[2,4,8]}]'
if [ "$PH" = c ]; then
run mla128s 200 python3 scripts/bench_kernels.py --only mla --batch 16 64 --context 2048 8192 --heads 128 --kv bf16 --sweep --sweep-kv bf16 --grid "$GC"
run compile_27 150 python3 scripts/bench_decode.py --preset deepseek-v2-lite --concurrency 256 --input-len 2000 --output-len 16 --steps 3 --warmup 1 --fill random --kv-dtype fp8 --kernels auto --compile-time
for K in mgpu pallas; do
run step197_$K 110 env MOEJAX_MLA_KERNEL=$K python3 scripts/bench_decode.py --preset deepseek-v3-ep8-rank --layers 4 --concurrency 197 --input-len 2048 --fill random --kernels auto --weight-dtype fp8 --steps 10
done
fi
# d (next session): the FP8 path on rows padded to 640 bytes (fp8_row_dim): its device tests, then 128 heads x
#    197 / 512 x 2048 FP8 against Triton (the kernel selected now), in one run.
GD='[{"kernel":["triton"]},{"kernel":["mgpu"],"block_t":[64],"num_stages":[2],"num_splits":[1]}]'
if [ "$PH" = d ]; then
run pytest 100 env JAX_PLATFORMS=cuda python3 -m pytest -q -n0 -p no:cacheprovider -o addopts="" tests/test_mgpu_mla_decode.py
run mla128fp8 150 python3 scripts/bench_kernels.py --only mla --batch 197 512 --context 2048 --heads 128 --kv fp8 --sweep --sweep-kv fp8 --grid "$GD"
fi
