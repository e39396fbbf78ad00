#!/usr/bin/env bash
# The GPU checklist's measurements in one pass on a GPU machine (README, "On a GPU machine"): each step under its
# own time limit, its output in LOGS/<step>.log, so that one step's failure or overrun loses none of the others.
#
#   bash bench/gpu_checks.sh [LOGS]        # LOGS defaults to $OUT, else gpu_checks/
#
# The machine's own torch stays; the project goes in with `pip install --no-deps -e .` and the packages the image
# lacks from wheels in .whl/ (built or downloaded on a machine that reaches the registry), if that folder exists.
set -u
LOGS=${1:-${OUT:-gpu_checks}}
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >"$LOGS/install.log" 2>&1 || { echo "wheel install failed"; cat "$LOGS/install.log"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >>"$LOGS/install.log" 2>&1 \
  && echo "pip install --no-deps -e . : ok" || echo "pip install --no-deps -e . : FAILED (see install.log)"

step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc $rc, $((SECONDS - t0)) s"
  grep -E "ratio|ms/step|MFU|tokens/s|max \|difference\||FAILED|summary|questions/s|passed|failed|skipped|Error" \
    "$LOGS/$name.log" | tail -40
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers, deepspeed; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'nccl', '.'.join(map(str, torch.cuda.nccl.version())), 'transformers', transformers.__version__, \
'deepspeed', deepspeed.__version__)"
} 2>&1 | tee "$LOGS/versions.log"

step zoo_against_timm "${ZOO_S:-150}" python3 bench/zoo_against_timm.py
step eval_throughput "${EVAL_S:-150}" python3 bench/eval_throughput.py --rounds 3
step llava7b_step "${LLAVA_S:-180}" deepspeed --num_gpus 1 bench/llava7b_step.py --steps 5 --batch 4 --generate 32
step family_step "${FAMILY_S:-300}" deepspeed --num_gpus 1 bench/family_step.py --family all --steps 3 --batch 4 \
  --generate 32 --rounds 2
if [ -n "${LAUNCH_S:-}" ]; then
  MCIT_TEST_ACCELERATOR=cuda step launch_tests "$LAUNCH_S" python3 -m pytest -q -x tests/launch -p no:cacheprovider
fi
