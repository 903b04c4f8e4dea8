#!/bin/bash
# GPTQ of MODEL_DIR, PAIRS times (default 3): 1 process x 1 thread, then 2 gloo processes x 1 thread (torchrun),
# each command with per-process phase timers (ddp_phases.py); OUT: where the outputs and logs go
set -e
M=${1:?usage: ddp_time.sh MODEL_DIR}
O=${OUT:-/tmp}
HERE=$(dirname "$0")
ARGS="quantize $M --recipe w4a16-gptq --calib ref --calib-samples 16 --calib-seq-len 256"
for i in $(seq ${PAIRS:-3}); do
  rm -rf $O/ddp-one $O/ddp-two
  s=$(date +%s.%N); OMP_NUM_THREADS=1 python $HERE/ddp_phases.py $ARGS --out $O/ddp-one > $O/ddp-one-$i.log 2>&1; e=$(date +%s.%N)
  echo "one $(echo "$e - $s" | bc)"; grep -o '\[rank [0-9]*\] wall.*' $O/ddp-one-$i.log
  s=$(date +%s.%N); OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 $HERE/ddp_phases.py $ARGS --out $O/ddp-two > $O/ddp-two-$i.log 2>&1; e=$(date +%s.%N)
  echo "two $(echo "$e - $s" | bc)"; grep -o '\[rank [0-9]*\] wall.*' $O/ddp-two-$i.log
done
