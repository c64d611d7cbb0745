#!/usr/bin/env bash
# GPU call 1 (2026-12-06d, issue 40): baseline MLA kernels at the points (Pallas, Triton, XLA),
# Nsight Compute on both kernels at 128 heads x 512 x 2048, a Mosaic GPU probe, MTP at two layer counts,
# the CUDA-only tests.
set -u
R=/tmp/r1; mkdir -p $R; OUT0=$OUT
pack() { tar czf $OUT0/r.tgz -C /tmp r1; }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total,driver_version --format=csv > $R/gpu.txt
python3 -m pip install --no-deps .whl/jax_triton-0.3.1-py3-none-any.whl > $R/pip.txt 2>&1
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
run() { local name=$1 t=$2; shift 2; local s=$SECONDS; timeout $t "$@" > $R/$name.txt 2>&1; echo "$name rc=$? $((SECONDS-s))s"; pack; }
D=benchmarks/2026-12-06d
G='[{"kernel":["pallas"]},{"kernel":["triton"]}]'
run mla128 120 python3 scripts/bench_kernels.py --only mla --batch 197 512 --context 2048 --heads 128 --kv bf16 fp8 --sweep --sweep-kv bf16 fp8 --grid "$G"
run mla16 60 python3 scripts/bench_kernels.py --only mla --batch 256 --context 2048 --heads 16 --kv bf16 fp8 --sweep --sweep-kv bf16 fp8 --grid "$G"
run rows 100 python3 scripts/bench_kernels.py --only mla --batch 64 197 --context 2048 --heads 128 16 --kv bf16 fp8 --rows 1 2 3 4
run pytest 60 env JAX_PLATFORMS=cuda python3 -m pytest -q -n0 -p no:cacheprovider -o addopts="" tests/test_triton_mla_decode.py
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
S="--section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section SchedulerStats"
run ncu_triton 90 $NCU --clock-control none --kernel-name regex:mla --launch-skip 2 --launch-count 1 $S python3 $D/mla_ncu_driver.py triton bf16
run mosaic 60 python3 $D/mosaic_probe.py
B="python3 scripts/bench_spec_decode.py --preset deepseek-v3-ep8-rank --batch 16,64,197 --k 0,1,2 --input-len 1000 --steps 6 --warmup 2"
run spec 200 $B --layers 2,4 --json $R/spec.json
