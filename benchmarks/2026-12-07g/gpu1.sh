#!/usr/bin/env bash
# GPU calls (2026-12-07g; no device was lent that session: none of this has run yet). From gpusnap/ (a snapshot
# of HEAD): bash benchmarks/2026-12-07g/gpu1.sh PHASE. Order: d (issue 40's kernels), e (issue 42: a decode
# program's XLA build by flags), then issues 42/43 served: WARM=1 bash benchmarks/2026-12-07g/serve_gpu.sh cold
# (~8 min: its own call), then ... cached (~4 min).
set -u
PH=${1:-d}
R=/tmp/r; mkdir -p $R; OUT0=$OUT
pack() { tar czf $OUT0/r.tgz -C /tmp r; }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total,driver_version --format=csv > $R/gpu.txt
python3 -m pip install --no-deps ../.whl/jax_triton-0.3.1-py3-none-any.whl > $R/pip.txt 2>&1
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
run() { local name=$1 t=$2; shift 2; local s=$SECONDS; timeout $t "$@" > $R/$name.txt 2>&1; echo "$name rc=$? $((SECONDS-s))s" | tee -a $R/log.txt; pack; }
NCU="ncu --clock-control none --launch-count 1 --kernel-name regex:entry|mla|mosaic|mgpu|pallas"
SECS="--section SpeedOfLight --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats"
# d: the Mosaic GPU kernel's FP8 path on rows padded to 640 bytes (fp8_row_dim): its device tests, then 128 heads
#    x 197 / 512 x 2048 FP8 against Triton (selected now) and bf16 mgpu, in one run; ncu of the bf16 kernel at 512.
GD='[{"kernel":["triton"]},{"kernel":["mgpu"],"block_t":[64],"num_stages":[2],"num_splits":[1]}]'
if [ "$PH" = d ]; then
run pytest 120 env JAX_PLATFORMS=cuda python3 -m pytest -q -n0 -p no:cacheprovider -o addopts="" tests/test_mgpu_decode_attention.py
run mla128fp8 170 python3 scripts/bench_kernels.py --only mla --batch 197 512 --context 2048 --heads 128 --kv fp8 bf16 --sweep --sweep-kv fp8 --grid "$GD"
run ncu_bf16 120 $NCU $SECS python3 benchmarks/2026-12-07g/mgpu_ncu.py 512 bf16
grep -q "No kernels were profiled" $R/ncu_bf16.txt && run ncu_names 90 ncu --clock-control none --launch-count 15 --section LaunchStats python3 benchmarks/2026-12-07g/mgpu_ncu.py 64 bf16
run ncu_fp8 120 $NCU $SECS python3 benchmarks/2026-12-07g/mgpu_ncu.py 512 fp8
# the speculative verify's Q rows a sequence together in the Mosaic GPU kernel (Q x 64/Q heads a CTA, the
# context read once) against Triton's rows together and the per-row kernel selected now
run mla128rows 240 python3 scripts/bench_kernels.py --only mla --batch 64 197 --context 2048 --heads 128 --kv bf16 fp8 --rows 2 3 4
# Step3's MFA on the Mosaic GPU kernel against the Pallas kernel selected now and XLA (context 4096)
run mfa 150 python3 scripts/bench_kernels.py --only mfa --batch 32 64 256 --sweep --grid '[{"kernel":["mgpu"],"block_t":[64],"num_stages":[2],"num_splits":[1,2,4]}]'
fi
# e (issue 42): what a V2-Lite decode program's XLA build (12.26 s at 27 layers in 2026-12-07f, superlinear in
#    layers: 2 / 4 layers 1.68 / 1.88 s) spends, by XLA flags, each with the step it builds timed (B = 256,
#    context 2000, FP8 KV, kernels auto): default; GEMM autotuning off; the latency-hiding scheduler off (one
#    GPU: no collective to hide); XLA's Triton GEMM fusions off (cuBLAS only: no Triton GEMM autotuning); both
#    of the first two; rematerialisation off.
if [ "$PH" = e ]; then
for V in default autotune0 notritongemm nolhs both noremat; do
  case $V in default) F="";; autotune0) F="--xla_gpu_autotune_level=0";;
    notritongemm) F="--xla_gpu_enable_triton_gemm=false";;
    nolhs) F="--xla_gpu_enable_latency_hiding_scheduler=false";;
    both) F="--xla_gpu_autotune_level=0 --xla_gpu_enable_latency_hiding_scheduler=false";;
    noremat) F="--xla_disable_hlo_passes=rematerialization";; esac
  run xla_$V 120 env XLA_FLAGS="$F" python3 scripts/bench_decode.py --preset deepseek-v2-lite --concurrency 256 --input-len 2000 --output-len 16 --steps 10 --warmup 2 --fill random --kv-dtype fp8 --kernels auto --compile-time
done
fi
# f (issue 40): the speculative verify through the Mosaic GPU kernel with a sequence's rows together
#    (MOEJAX_MLA_KERNEL=mgpu) against the rows each on their own (auto: mgpu per row), bf16 cache, 4 and 2
#    layers + MTP, k = 0 / 1 (the depth projection from the pair); Step3's 4-layer step with MFA on the
#    Mosaic GPU kernel (MOEJAX_MFA_KERNEL=mgpu) against the Pallas one.
if [ "$PH" = f ]; then
for K in mgpu auto; do
run spec_$K 280 env MOEJAX_MLA_KERNEL=$K python3 scripts/bench_spec_decode.py --preset deepseek-v3-ep8-rank --layers 2,4 --batch 16,64,197 --k 0,1 --input-len 2000 --kv-dtype bf16 --json $R/spec_$K.json
done
for K in mgpu pallas; do
run step3_$K 120 env MOEJAX_MFA_KERNEL=$K python3 scripts/bench_decode.py --preset step3-ep8-rank --layers 4 --concurrency 64 --input-len 4096 --fill random --kernels auto --steps 10
done
fi
