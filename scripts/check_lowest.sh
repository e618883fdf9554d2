#!/usr/bin/env bash
# Check the lowest declared versions: a throwaway virtual environment outside the repository
# with torch, transformers, accelerate, huggingface_hub, peft and safetensors at the lowest
# versions pyproject.toml declares (no datasets, gguf, evaluate, lm_eval, matplotlib, optimum,
# mergekit), this package installed --no-deps from a clean export of HEAD, `pip check` (the
# declared requirements hold for that set), then the tests of import, prune, save and card
# without the extras (tests/test_utils_extras.py), LoRA healing (peft) and the device placement and
# memory budget tests (accelerate's helpers). Not run by CI: it downloads and installs a few
# hundred MB and takes minutes.
#   bash scripts/check_lowest.sh                 # venv in $LOWEST_VENV (default: /tmp/hf-layerswap-lowest)
#   TORCH=2.11.0 bash scripts/check_lowest.sh    # another torch (the CPU wheel where pip finds it)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${LOWEST_VENV:-/tmp/hf-layerswap-lowest}
case "$VENV" in "$ROOT"|"$ROOT"/*) echo "check_lowest.sh: LOWEST_VENV must lie outside the repository" >&2; exit 2 ;; esac
PY=${PYTHON:-python3}
TORCH=${TORCH:-2.13.0}
# the lowest versions pyproject.toml declares (keep the two in step)
LOWEST=("transformers==5.17.0" "accelerate==1.15.0" "huggingface_hub==1.33.0" "peft==0.13.2"
        "safetensors==0.8.0" "numpy==1.26.4")
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q "torch==$TORCH" "${LOWEST[@]}" psutil filelock tqdm jinja2 pyyaml pytest hypothesis
SRC=$(mktemp -d)
trap 'rm -rf "$SRC"' EXIT
git archive HEAD | tar -x -C "$SRC"
$PIP install -q --no-deps --force-reinstall "$SRC"
$PIP check
# distributions, not import names: this package ships the namespace optimum.commands.register
for name in datasets gguf evaluate lm-eval matplotlib optimum mergekit; do
  if "$VENV/bin/python" -c "import importlib.metadata as m, sys
try: m.distribution('$name')
except m.PackageNotFoundError: sys.exit(1)"; then
    echo "check_lowest.sh: $name is installed in $VENV; the check wants it absent" >&2; exit 2
  fi
done
"$VENV/bin/python" -c "import torch, transformers, accelerate, huggingface_hub, peft, safetensors, numpy
print('versions:', ', '.join(f'{m.__name__} {m.__version__}' for m in (torch, transformers, accelerate, huggingface_hub, peft, safetensors, numpy)))"
# test_the_card_draws_its_plots... needs matplotlib, absent here by design
HF_HUB_OFFLINE=1 PYTHONPATH="$ROOT" "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
  tests/test_utils_extras.py tests/test_healing.py tests/test_utils_devices.py tests/test_scoring_settings.py \
  -k "extras and not matplotlib_is_there or ghosted_repair_are_refused or teacher_goes or launch or tied_head or budget"
