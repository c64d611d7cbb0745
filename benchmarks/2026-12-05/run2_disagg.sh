#!/usr/bin/env bash
# Issue 23 on one H200 (NOT run yet: no device was lent on 2026-12-05): (1) KV transfer bandwidth of a
# 2k-token DeepSeek-V3-shaped latent cache between two processes sharing the GPU, bf16 and FP8 rows;
# (2) TTFT / ITL / TPOT p50/p90/p99, colocated (85% of the GPU's memory) against 1 prefill + 1 decode
# worker (40% each) at the same Poisson request rate, mixed lengths, a random V2-Lite-shaped 4-layer model.
set -u
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
for dt in auto fp8; do
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 timeout 120 python3 scripts/probe_kv_transfer.py --tokens 2048 --kv-cache-dtype $dt \
    --repeats 10 2>&1 | grep -vE "^W1|Warn" | tail -4 | tee $OUT/probe_$dt.txt
done
timeout 120 python3 scripts/make_tiny_checkpoint.py /tmp/v2l8 --preset deepseek-v2-lite --set num_hidden_layers=4 \
  --dtype bfloat16 --via numpy > /dev/null
timeout 400 python3 scripts/bench_disaggregated.py --model /tmp/v2l8 --mem-fraction 0.85 --worker-mem-fraction 0.4 \
  --num-prompts 200 --request-rate 4 --random-input-len 2000 --random-output-len 200 --random-range-ratio 0.5 \
  --out-dir $OUT/disagg -- --max-num-seqs 64 --max-model-len 4096 --kernels auto 2>&1 | tail -16 | tee $OUT/disagg_summary.txt
