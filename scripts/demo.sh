#!/usr/bin/env bash
# The demo: P = 2 CPU ranks train a small transformers Llama with backend "ulysses", next to eager.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/demo.py "$@"
