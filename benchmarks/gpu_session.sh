#!/usr/bin/env bash
# One device session's run, in the repository root of a GPU machine:
#   OUT=/some/dir bash benchmarks/gpu_session.sh
# 1. the kernel check (benchmarks/gpu_check.py) as three processes, one per
#    dtype, sharing the GPU (each takes 30 % of its memory): their compiles
#    overlap, so its timing columns are read with other processes' kernels
#    running beside them; the pass/fail columns are unaffected;
# 2. then, alone on the GPU, the training steps (benchmarks/gpu_steps.py).
# Eight files come back under $OUT: env.txt, check_<dtype>.md and .log, steps.log.
set -u
OUT=${OUT:-/tmp/gpu_session}
CHECK_LIMIT=${CHECK_LIMIT:-330}
STEPS_LIMIT=${STEPS_LIMIT:-150}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
    date -u
    nvidia-smi
    "$PY" -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
    "$PY" -c "import rumus_fx as rf; print('rumus_fx', rf.__version__, 'kernels:', rf.kernels.backend())"
} >"$OUT/env.txt" 2>&1
KERNELS=softmax,layer_norm,cross_entropy,batch_norm,matmul,bmm,attention,embedding
pids=()
for dt in float32 bfloat16 float16; do
    only=$KERNELS
    [ "$dt" = float32 ] && only="$KERNELS,e2e"  # the end-to-end rows once
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.3 "$PY" benchmarks/gpu_check.py --dtypes "$dt" --only "$only" \
        --out "$OUT/check_$dt.md" --time-limit "$CHECK_LIMIT" >"$OUT/check_$dt.log" 2>&1 &
    pids+=($!)
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
"$PY" benchmarks/gpu_steps.py --out "$OUT/steps.md" --time-limit "$STEPS_LIMIT" >"$OUT/steps.log" 2>&1 || status=1
rm -f "$OUT/steps.md"  # its table is in steps.log (eight files come back)
tail -n 3 "$OUT"/check_*.log "$OUT/steps.log"
exit $status
