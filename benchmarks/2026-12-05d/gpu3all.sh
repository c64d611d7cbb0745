#!/usr/bin/env bash
# gpu3.sh then gpu3b.sh in one call (one machine start): results in $OUT/a/r.tgz and $OUT/b/r.tgz.
O=$OUT; mkdir -p $O/a $O/b
OUT=$O/a bash benchmarks/2026-12-05d/gpu3.sh
OUT=$O/b bash benchmarks/2026-12-05d/gpu3b.sh
