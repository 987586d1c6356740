#!/usr/bin/env bash
# Creates .venv (once) with the CPU build of torch 2.13 and this package with its test extra.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if ! .venv/bin/python -c "import torch, transformers, accelerate, peft, pytest, xdist, expecttest, hypothesis, ulysses_compile" 2>/dev/null; then
  .venv/bin/python -m pip install --quiet torch==2.13.0
  .venv/bin/python -m pip install --quiet -e ".[test]"
fi
