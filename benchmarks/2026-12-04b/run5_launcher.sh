#!/usr/bin/env bash
# Issue 22: one process through the launcher against the plain run on the H200 (the embedded tiny random
# model, greedy): the same texts, and the launcher's overhead in wall time (interleaved, twice each).
set -u
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
for i in 1 2; do
  s=$(date +%s.%N); timeout 60 python3 scripts/generate.py --max-new-tokens 32 > $OUT/plain_$i.txt 2>&1; e=$(date +%s.%N)
  echo "plain run $i: $(echo "$e - $s" | bc) s" | tee -a $OUT/times.txt
  s=$(date +%s.%N); timeout 60 python3 -m moejax.launch --nproc 1 -- scripts/generate.py --max-new-tokens 32 > $OUT/launch_$i.txt 2>&1; e=$(date +%s.%N)
  echo "launcher --nproc 1 run $i: $(echo "$e - $s" | bc) s" | tee -a $OUT/times.txt
done
grep -E "tokens in" $OUT/plain_1.txt $OUT/launch_1.txt $OUT/plain_2.txt $OUT/launch_2.txt | tee -a $OUT/times.txt
for f in plain_2 launch_1 launch_2; do
  if diff <(grep -A1 "^###" $OUT/plain_1.txt) <(grep -A1 "^###" $OUT/$f.txt) > /dev/null; then echo "$f: texts equal to plain_1"; else echo "$f: TEXTS DIFFER"; fi
done | tee -a $OUT/times.txt
