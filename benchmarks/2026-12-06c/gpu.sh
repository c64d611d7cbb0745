#!/usr/bin/env bash
# GPU calls of 2026-12-06c (issue 31): `bash gpu.sh E` then `bash gpu.sh F`; outputs packed into $OUT/r.tgz.
# E: the node projection's inputs (8-layer FP8 steps at 2048 context), Step3 at the seed's point, profiles.
# F: the 512-context table and the 2048 table with today's selection.
set -u
G=$1; R=/tmp/r$G; mkdir -p $R; OUT0=$OUT
pack() { tar czf $OUT0/r.tgz -C /tmp r$G; }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $R/gpu.txt
python3 -m pip install --no-deps .whl/jax_triton-0.3.1-py3-none-any.whl > $R/pip.txt 2>&1
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
run() { local name=$1 t=$2; shift 2; timeout $t "$@" > $R/$name.txt 2>&1; echo "$name rc=$?"; pack; }
B="python3 scripts/bench_decode.py --preset deepseek-v3-ep8-rank --fill random --kernels auto --steps 10"
if [ $G = E ]; then
  run v3l8 200 $B --layers 8 --input-len 2048 --concurrency 128,256,512 --weight-dtype fp8 --json $R/v3l8.json
  run step3 100 python3 scripts/bench_decode.py --preset step3-ep8-rank --layers 4 --concurrency 32 --input-len 4096 \
    --fill random --kernels auto --steps 10 --weight-dtype bf16,fp8 --json $R/step3.json
  for w in bf16 fp8; do
    run prof_$w 90 env XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 scripts/profile_step.py \
      --preset deepseek-v3-ep8-rank --layers 4 --concurrency 512 --input-len 2048 --kernels auto --weight-dtype $w \
      --steps 3 --top 30 --json $R/prof_$w.json
  done
else
  run t512 150 $B --layers 4 --input-len 512 --concurrency 16,64,256 --weight-dtype bf16,fp8 --json $R/t512.json
  run t2048 240 $B --layers 4 --input-len 2048 --concurrency 16,64,256,512 --weight-dtype bf16,fp8 --json $R/t2048.json
fi
