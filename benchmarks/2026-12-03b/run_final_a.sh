#!/bin/bash
# Selected kernels at the shapes, then V2-Lite decode at c256 (auto vs XLA, with components).
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0
B=scripts/bench_kernels.py
python $B --only mla --batch 64 256 --context 2048 8192 --heads 128 16 --kv bf16 fp8 > $OUT/kernels_mla.txt 2>&1
python $B --only mfa --batch 32 64 256 --sweep --grid '{"num_stages":[2,3]}' > $OUT/kernels_mfa.txt 2>&1
cut -c1-200 $OUT/kernels_mla.txt $OUT/kernels_mfa.txt
python scripts/bench_decode.py --preset deepseek-v2-lite --concurrency 256 --input-len 2000 --output-len 20 \
  --steps 10 --warmup 3 --fill random --kernels auto,xla --components --json $OUT/decode_deepseek-v2-lite_c256.json \
  > $OUT/v2lite_c256.txt 2>&1
tail -n 6 $OUT/v2lite_c256.txt
