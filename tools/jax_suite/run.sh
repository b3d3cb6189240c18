#!/usr/bin/env bash
# Run a test suite with every gradient also taken on rf's tape (conftest.py, loaded as
# the pytest plugin _rf_probe, so a suite's own conftest.py stays in force).
#   tools/jax_suite/run.sh TESTS_DIR OUT_DIR test_file.py [...]
# TESTS_DIR: jax's tests/ directory at the installed jax's release tag (from a jax
# checkout: git archive jax-vX.Y.Z tests | tar -x), or a library's checkout at its
# installed release (then name files as tests/test_x.py). Each file's log:
# OUT_DIR/<file>.jsonl. PROBE_TRACED=1 also probes gradients taken inside traces.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
src=$1 out=$2
shift 2
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d)
cp -r "$src"/. "$work"
cp "$here/conftest.py" "$work/_rf_probe.py"
for f in "$@"; do
  log="$out/$(echo "${f%.py}" | tr / _)"
  (cd "$work" && PYTHONPATH="$work${PYTHONPATH:+:$PYTHONPATH}" PROBE_LOG="$log.jsonl" \
    python -m pytest -q -n 2 -p _rf_probe -p no:cacheprovider "$f" >"$log.txt" 2>&1) || true
  echo "== $f"
  python "$here/summarize.py" "$log.jsonl" || true
done
rm -rf "$work"
