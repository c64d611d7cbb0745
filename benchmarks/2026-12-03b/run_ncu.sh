#!/bin/bash
# Nsight Compute on the MLA pages kernel (16 and 128 heads, batch 256, context 2048, bf16) and the
# fused MoE at V2-Lite's shape (8 tokens/expert), selected configs: occupancy, registers, memory
# throughput and warp stall reasons. Output in $OUT.
export PYTHONPATH=$PWD MOEJAX_PALLAS_INTERPRET=0
which ncu || ls /opt/nvidia/nsight-compute/*/ncu
NCU="ncu --clock-control none --launch-skip 3 --launch-count 1 --section SpeedOfLight --section Occupancy \
 --section LaunchStats --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats"
B=scripts/bench_kernels.py
$NCU -k regex:mla python $B --only mla --batch 256 --context 2048 --heads 16 --kv bf16 > $OUT/ncu_mla16.txt 2>&1
$NCU -k regex:mla python $B --only mla --batch 256 --context 2048 --heads 128 --kv bf16 > $OUT/ncu_mla128.txt 2>&1
$NCU -k regex:moe python $B --only moe --moe-shapes v2-lite --tokens 8 > $OUT/ncu_moe_gate_up.txt 2>&1
$NCU -k regex:moe_down python $B --only moe --moe-shapes v2-lite --tokens 8 > $OUT/ncu_moe_down.txt 2>&1
grep -h -E "Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Memory Throughput|DRAM Through|Block Limit|Shared Memory Config|Dynamic Shared|Waves Per SM|Grid Size|Block Size" $OUT/ncu_*.txt
# values through their own load (v_offset=0: the same columns read twice) vs the key tile reused
python $B --only mla --batch 256 --context 2048 --heads 16 128 --kv bf16 --sweep --grid '{"v_offset":[0]}' > $OUT/kernels_mla_vload_sweep.txt 2>&1
cut -c1-200 $OUT/kernels_mla_vload_sweep.txt
