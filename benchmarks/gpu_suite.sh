#!/usr/bin/env bash
# rf's own gradient tests and the model zoo on a GPU, in one device session:
#   OUT=/some/dir bash benchmarks/gpu_suite.sh
# 1. the model zoo (python -m benchmarks.zoo), alone on the GPU: lifted haiku,
#    flax, equinox, diffrax and LLaMA losses against jax.grad;
# 2. the tests that compare every op's and every lifted primitive's gradients
#    with jax.grad (tests/ops, tests/nn, tests/test_transforms.py,
#    tests/test_no_silent_gradient.py, tests/lift/test_ptable.py), under pytest
#    on the GPU: the kernels in `auto` mode, which on a GPU is the Pallas
#    kernels, with jax_default_matmul_precision=highest, so the kernels' dots
#    (Triton's IEEE input precision) and jax.grad's oracle are both float32,
#    not TF32, and the tests' float32 tolerances apply as on CPU.
# Four files come back under $OUT: env.txt, zoo.log, tests_ops.log, tests_lift.log.
# Each step has a hard time limit; the logs are written as they go, so a step
# cut short still reports what it finished.
set -u
OUT=${OUT:-/tmp/gpu_suite}
ZOO_LIMIT=${ZOO_LIMIT:-200}
OPS_LIMIT=${OPS_LIMIT:-200}
LIFT_LIMIT=${LIFT_LIMIT:-110}
WORKERS=${WORKERS:-14}
ZOO_RUNS=${ZOO_RUNS:-2}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    "$PY" -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
    "$PY" -c "import rumus_fx as rf; print('kernels:', rf.kernels.backend())"
    "$PY" -m pip list 2>/dev/null | grep -i -E "^(flax|dm-haiku|equinox|diffrax|optax|chex|hypothesis|pytest) "
} >"$OUT/env.txt" 2>&1
status=0
timeout "$ZOO_LIMIT" "$PY" -m benchmarks.zoo --runs "$ZOO_RUNS" >"$OUT/zoo.log" 2>&1 || status=1
run_tests() {  # $1 = log name, $2 = time limit, the rest = test paths
    local log=$1 limit=$2
    shift 2
    JAX_DEFAULT_MATMUL_PRECISION=highest XLA_PYTHON_CLIENT_PREALLOCATE=false \
        timeout "$limit" "$PY" -m pytest -n "$WORKERS" -p no:cacheprovider \
        -v --tb=short "$@" >"$OUT/$log" 2>&1 || status=1
}
run_tests tests_ops.log "$OPS_LIMIT" tests/ops tests/nn tests/test_transforms.py tests/test_no_silent_gradient.py
run_tests tests_lift.log "$LIFT_LIMIT" tests/lift/test_ptable.py
tail -n 2 "$OUT/zoo.log" "$OUT/tests_ops.log" "$OUT/tests_lift.log"
grep -h -E "^(FAILED|ERROR) " "$OUT"/tests_*.log | head -n 40
exit $status
