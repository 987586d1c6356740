#!/usr/bin/env bash
# Creates .venv (once) with the CPU build of torch 2.13 and this package with its test extra.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# An install of an older version of this package (another entry point) is refreshed too.
if ! .venv/bin/python -c "import torch, transformers, accelerate, peft, pytest, xdist, expecttest, hypothesis, ulysses_compile
from importlib.metadata import entry_points
assert [e.value for e in entry_points(group='torch_dynamo_backends', name='ulysses')] == ['ulysses_compile.entry_point:ulysses']" 2>/dev/null; then
  .venv/bin/python -m pip install --quiet torch==2.13.0
  .venv/bin/python -m pip install --quiet -e ".[test]"
fi
