#!/usr/bin/env bash
# The GPU acceptance check, one prepared run on a single-GPU machine as it comes: its own torch, CUDA
# and transformers (which may be older than ours; it may have no network), with this package installed
# onto them without its dependencies. It prints the versions it ran on, then what each check measured:
#   - the demo at P = 1 on the GPU (examples/demo.py: loss and gradients against eager, Inductor);
#   - the suite's GPU tests (pytest -m gpu: bf16, FlexAttention's backward, flash-attn where installed);
#   - one rank's program of Llama-3-8B at 128K tokens, P = 8, ZeRO-3, bf16 (examples/real_scale.py):
#     compile time, step time, the step's peak GPU memory beside explain's estimate, its collectives;
#   - the longest sequence explain plans for that rank within the GPU's free memory.
# Figures go to $OUT (default: a new temporary folder) as JSON and text.
#
#   bash scripts/gpu_check.sh             # on the GPU machine (about 5 minutes)
#   bash scripts/gpu_check.sh --dry-run   # the same steps on CPU at the tiny size (tests/test_real_scale.py)
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python}"
out="${OUT:-$(mktemp -d)}"
mkdir -p "$out"
case "${1:-}" in
    --dry-run)
        demo=(--world-size 1 --steps 1 --device cpu --compiler aot_eager)
        tests=(--collect-only)
        job=(--size tiny --device cpu --steps 1)
        plan=(examples/real_scale.py:tiny --world-size 8 --zero-stage 3 --max-memory 1GiB) ;;
    "")
        # backend="ulysses" is found through the package's entry point: installed, without dependencies or
        # a build environment (no network needed)
        "$python" -m pip install --no-deps --no-build-isolation -q -e .
        demo=(--world-size 1 --steps 3 --device cuda)
        tests=()
        job=(--size 8b --device cuda --steps 2)
        memory=$("$python" -c "import torch; print(torch.cuda.mem_get_info()[0])")  # free, not total
        plan=(examples/real_scale.py:llama_8b --world-size 8 --zero-stage 3 --param-dtype bfloat16
              --reduce-dtype float32 --max-memory "${memory}B") ;;
    *)
        echo "usage: bash scripts/gpu_check.sh [--dry-run]" >&2
        exit 2 ;;
esac
"$python" -c "
import torch, transformers
device = torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'
print(f'ran on {device}: torch {torch.__version__}, CUDA {torch.version.cuda}, transformers {transformers.__version__}')
" | tee "$out/versions.txt"
"$python" examples/demo.py "${demo[@]}" | tee "$out/demo.txt"
# a failing GPU test is reported in its file and the figures below are still taken
"$python" -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py "${tests[@]}" > "$out/gpu_tests.txt" 2>&1 || true
tail -n 3 "$out/gpu_tests.txt"
"$python" examples/real_scale.py "${job[@]}" --out "$out/real_scale.json" | tee "$out/real_scale.txt"
"$python" -m ulysses_compile explain "${plan[@]}" > "$out/explain.txt"
grep -A 9 "^max memory" "$out/explain.txt" | tee "$out/longest.txt"
echo "figures in $out"
