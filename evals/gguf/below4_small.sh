# ref:small in llama-quantize's Q3_K_M and Q2_K mixes: quantkit RTN (byte for byte llama-quantize's own file without an
# importance matrix: tests/test_gguf_llama_cpp.py) and GPTQ (4096 calibration tokens of the reference corpus), each
# file scored by quantkit eval against the float model (8 windows of 512 tokens). Run from the repository root.
set -x
mkdir -p ${OUT:-/tmp/below4}
for r in w3a16-rtn-q3km w3a16-gptq-q3km w2a16-rtn-q2k w2a16-gptq-q2k; do
  calib=""
  case $r in *gptq*) calib="--calib ref --calib-samples 16 --calib-seq-len 256";; esac
  /usr/bin/time -f "$r quantize %e s" quantkit quantize ref:small --recipe $r $calib --out ${OUT:-/tmp/below4}/$r.gguf --force > ${OUT:-/tmp/below4}/$r.q.log 2>&1
  quantkit eval ${OUT:-/tmp/below4}/$r.gguf --baseline ref:small --window 512 --max-tokens 4096 --json ${OUT:-/tmp/below4}/$r.json > ${OUT:-/tmp/below4}/$r.e.log 2>&1
done
echo ALLDONE
