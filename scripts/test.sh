#!/usr/bin/env bash
# The test suite: one-process structure tests and real gloo ranks against eager, in two pytest workers
# (compiling is single-threaded Python; the ranks' processes share the cores as they would alone).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -n 2 --durations=15 "$@"
