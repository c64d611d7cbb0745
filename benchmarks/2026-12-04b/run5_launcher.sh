#!/usr/bin/env bash
# Issue 22: one process through the launcher against the plain run on the H200 (the embedded tiny random
# model, greedy): the same texts, and the launcher's overhead (generate.py's own timing; interleaved, twice each).
# As run on 2026-12-04 the script also timed each command with `bc`, which that machine lacks (empty lines
# in the output); those lines are removed here.
set -u
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0 PYTHONUNBUFFERED=1
for i in 1 2; do
  timeout 60 python3 scripts/generate.py --max-new-tokens 32 > $OUT/plain_$i.txt 2>&1
  timeout 60 python3 -m moejax.launch --nproc 1 -- scripts/generate.py --max-new-tokens 32 > $OUT/launch_$i.txt 2>&1
done
grep -E "tokens in" $OUT/plain_1.txt $OUT/launch_1.txt $OUT/plain_2.txt $OUT/launch_2.txt | tee -a $OUT/times.txt
for f in plain_2 launch_1 launch_2; do
  if diff <(grep -A1 "^###" $OUT/plain_1.txt) <(grep -A1 "^###" $OUT/$f.txt) > /dev/null; then echo "$f: texts equal to plain_1"; else echo "$f: TEXTS DIFFER"; fi
done | tee -a $OUT/times.txt
