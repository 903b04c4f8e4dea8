#!/bin/bash
# GPTQ of MODEL_DIR: 1 process x 1 thread, then 2 gloo processes x 1 thread (torchrun); OUT: where the outputs go
set -e
M=${1:?usage: ddp_time.sh MODEL_DIR}
rm -rf ${OUT:-/tmp}/ddp-one ${OUT:-/tmp}/ddp-two
s=$(date +%s.%N); OMP_NUM_THREADS=1 python -m quantkit quantize $M --recipe w4a16-gptq --out ${OUT:-/tmp}/ddp-one --calib ref --calib-samples 16 --calib-seq-len 256 > ${OUT:-/tmp}/ddp-one.log 2>&1; e=$(date +%s.%N)
echo "one $(echo "$e - $s" | bc)"
s=$(date +%s.%N); OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 -m quantkit quantize $M --recipe w4a16-gptq --out ${OUT:-/tmp}/ddp-two --calib ref --calib-samples 16 --calib-seq-len 256 > ${OUT:-/tmp}/ddp-two.log 2>&1; e=$(date +%s.%N)
echo "two $(echo "$e - $s" | bc)"
