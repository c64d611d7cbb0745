#!/usr/bin/env bash
# Issue 31: why the Pallas-Triton W8A8 grouped GEMM is slow on Hopper. One GPU, under 4 minutes.
#   bash benchmarks/2026-12-05c/fp8_probe.sh            (from the repo root; $OUT set)
# Writes $OUT/fp8_probe.txt, fp8_probe.json, fp8_probe_ir.tar.gz, fp8_probe_log.txt (fp8_probe.py says what).
set -u
: "${OUT:?set OUT to the results folder}"
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > "$OUT/fp8_probe_gpu.txt" 2>&1
timeout 270 python3 benchmarks/2026-12-05c/fp8_probe.py --out "$OUT" "$@"
echo "fp8_probe exit $?"
