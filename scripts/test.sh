#!/usr/bin/env bash
# The test suite: one-process structure tests and real gloo ranks against eager.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
