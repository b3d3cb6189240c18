#!/usr/bin/env bash
# Run jax's own test files with every gradient also taken on rf's tape (conftest.py).
#   tools/jax_suite/run.sh JAX_TESTS_DIR OUT_DIR test_file.py [...]
# JAX_TESTS_DIR: jax's tests/ directory at the installed jax's release tag (from a jax
# checkout: git archive jax-vX.Y.Z tests | tar -x). Each file's log: OUT_DIR/<file>.jsonl.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
src=$1 out=$2
shift 2
mkdir -p "$out"
work=$(mktemp -d)
cp -r "$src"/. "$work"
cp "$here/conftest.py" "$work/conftest.py"
for f in "$@"; do
  PROBE_LOG="$out/${f%.py}.jsonl" python -m pytest -q -n 2 -p no:cacheprovider "$work/$f" >"$out/${f%.py}.txt" 2>&1 || true
  echo "== $f"
  python "$here/summarize.py" "$out/${f%.py}.jsonl" || true
done
rm -rf "$work"
