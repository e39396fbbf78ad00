# Shared body of the mcit Slurm job scripts (sourced by one_node.sbatch and multi_node.sbatch; not a job
# script itself). See those scripts' headers for the parameters.
set -uo pipefail

CONFIG=${1:?usage: sbatch pipelines/slurm/<script>.sbatch configs/X.yaml [key.path=value ...]}
shift
OVERRIDES=("$@")
ROOT=${MCIT_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
cd "$ROOT" || { echo "mcit: cannot cd to MCIT_ROOT=$ROOT" >&2; exit 2; }
[ -f pipelines/run_task_sequence.py ] || { echo "mcit: $ROOT is not an mcit checkout (submit from the repo root or set MCIT_ROOT)" >&2; exit 2; }
PY=${MCIT_PYTHON:-python}
LAUNCHER=${MCIT_LAUNCHER:-deepspeed}

# Nodes, master address and port, ranks per node: all from the allocation.
mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
NNODES=${SLURM_JOB_NUM_NODES:-${#HOSTS[@]}}
MASTER_ADDR=${MCIT_MASTER_ADDR:-${HOSTS[0]}}
MASTER_PORT=${MCIT_MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
if [ -n "${MCIT_GPUS_PER_NODE:-}" ]; then
  PER_NODE=$MCIT_GPUS_PER_NODE
elif [ -n "${SLURM_GPUS_ON_NODE:-}" ]; then
  PER_NODE=$SLURM_GPUS_ON_NODE
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  PER_NODE=$(nvidia-smi -L | wc -l)
else
  PER_NODE=1   # CPU nodes: one rank per node unless MCIT_GPUS_PER_NODE says otherwise
fi
export MASTER_ADDR MASTER_PORT

RUN_DIR=$("$PY" -c 'import sys; sys.path.insert(0, "."); from mcit.core.config import load_config; print(load_config(sys.argv[1], sys.argv[2:]).resolved_run_dir())' "$CONFIG" "${OVERRIDES[@]}") \
  || { echo "mcit: cannot read config $CONFIG" >&2; exit 2; }
RANK_LOGS=$RUN_DIR/logs/ranks/job${SLURM_JOB_ID}_restart${SLURM_RESTART_COUNT:-0}
mkdir -p "$RANK_LOGS"
echo "mcit: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on ${HOSTS[*]}: $NNODES node(s) x $PER_NODE rank(s), master $MASTER_ADDR:$MASTER_PORT, launcher $LAUNCHER, run dir $RUN_DIR"

# Stop requests reach every rank through the run directory (PREEMPT); they stop after the same step with a step
# checkpoint (mcit.core.preemption). Two kinds:
#  - USR1 (the time-limit warning, --signal=B:USR1@T, or `scancel --signal=USR1 --batch JOB`): a preemption; the
#    job requeues itself and resumes there. A TERM after a USR1 (the time limit itself) stays one.
#  - TERM with no USR1 before it (`scancel JOB`): a cancel; the ranks stop, the job is not requeued. The same
#    sbatch command later resumes from the last commit. (A preempting scheduler in REQUEUE mode requeues by itself.)
PREEMPTED=
CANCELLED=
request_stop() { PREEMPTED=1; echo "mcit: job $SLURM_JOB_ID got a stop signal (USR1); asking the ranks to checkpoint, then requeueing" >&2; touch "$RUN_DIR/PREEMPT"; }
request_cancel() {
  if [ -n "$PREEMPTED" ]; then return; fi  # the time limit after its warning: still a preemption
  CANCELLED=1; echo "mcit: job $SLURM_JOB_ID cancelled (TERM without a time-limit warning): stopping the ranks, not requeueing" >&2
  touch "$RUN_DIR/PREEMPT"
}
trap request_stop USR1
trap request_cancel TERM

launch() {  # the command line of one node's launcher ($1: node rank, or the literal \$SLURM_NODEID)
  local node_rank=$1
  case "$LAUNCHER" in
    deepspeed)
      echo "$PY -u -m deepspeed.launcher.runner --hostfile $RUN_DIR/logs/hostfile.$SLURM_JOB_ID --no_ssh --node_rank $node_rank" \
           "--num_nodes $NNODES --num_gpus $PER_NODE --master_addr $MASTER_ADDR --master_port $MASTER_PORT" \
           "--enable_each_rank_log $RANK_LOGS pipelines/run_task_sequence.py --config $CONFIG ${OVERRIDES[*]}" ;;
    torchrun)
      echo "$PY -m torch.distributed.run --nnodes $NNODES --nproc_per_node $PER_NODE --node_rank $node_rank" \
           "--master_addr $MASTER_ADDR --master_port $MASTER_PORT --log-dir $RANK_LOGS --redirects 3 --tee 3" \
           "pipelines/run_task_sequence.py --config $CONFIG ${OVERRIDES[*]}" ;;
    *) echo "mcit: MCIT_LAUNCHER must be deepspeed or torchrun, not $LAUNCHER" >&2; return 2 ;;
  esac
}
if [ "$LAUNCHER" = deepspeed ]; then
  for h in "${HOSTS[@]}"; do echo "$h slots=$PER_NODE"; done > "$RUN_DIR/logs/hostfile.$SLURM_JOB_ID"
fi

FOLLOW=
follow_rank0() {  # the deepspeed launcher writes each rank's output to its own file: rank 0's goes on into this
  # job's output too (slurm-<id>.out), so its progress lines and committed rows are where a cluster user looks
  [ "$LAUNCHER" = deepspeed ] || return 0  # torchrun's --tee already copies every rank's output here
  ( while :; do
      f=$(ls "$RANK_LOGS"/*_rank0.log 2>/dev/null | head -n 1)
      [ -n "$f" ] && exec tail -n +1 -F --pid=$$ "$f" 2>/dev/null  # ends with this shell, however it ends
      sleep 0.5
    done ) &
  FOLLOW=$!
}
stop_following() { [ -n "$FOLLOW" ] || return 0; sleep 1; kill "$FOLLOW" 2>/dev/null; wait "$FOLLOW" 2>/dev/null; FOLLOW=; }

run_and_wait() {  # run "$@" in the background so the trap fires at once; wait through the trap
  follow_rank0
  "$@" &
  local pid=$! rc
  while :; do
    wait "$pid"; rc=$?
    kill -0 "$pid" 2>/dev/null || break
  done
  stop_following
  return "$rc"
}

finish() {  # requeue on "resume me" (exit 75) or a stop request before the run finished
  local rc=$1
  if grep -q '"finished": true' "$RUN_DIR/state.json" 2>/dev/null; then
    echo "mcit: run finished (exit $rc)"; exit "$rc"
  fi
  if [ -n "$CANCELLED" ]; then
    echo "mcit: job $SLURM_JOB_ID cancelled; not requeued. Resubmit the same command to resume from the last commit" >&2
    exit "$rc"
  fi
  if [ "$rc" -eq 75 ] || [ -n "$PREEMPTED" ]; then
    if [ "${SLURM_RESTART_COUNT:-0}" -ge "${MCIT_MAX_REQUEUES:-20}" ]; then
      echo "mcit: not requeueing: already restarted ${SLURM_RESTART_COUNT} times (MCIT_MAX_REQUEUES)" >&2; exit 75
    fi
    echo "mcit: step checkpoint committed; requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID" && exit 0
    echo "mcit: scontrol requeue failed; resubmit the same command to resume" >&2; exit 75
  fi
  echo "mcit: run stopped with exit code $rc (see $RANK_LOGS)" >&2
  exit "$rc"
}
