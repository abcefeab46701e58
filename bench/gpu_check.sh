#!/usr/bin/env bash
# gpu_check.sh: what to run the day a GPU machine is at hand, in under 8 minutes (each part under `timeout`).
#
# Parts (GPU parts need `nvidia-smi` and torch.cuda.is_available(); without them each prints one SKIP line):
#   env        cpu  versions, the GPUs, the hardware-table key from the GPU's name (h100 / h200 / a100)
#   dist_nccl  gpu  bench/nccl_check.py under torchrun, 2 processes: the collectives (forward and backward) and the
#                   Llama's gradients on dp=2 / fsdp=2 / tp=2 over NCCL against one-device references, and comm_stats
#                   against lower(). The test suite's dist bodies cannot be pointed at NCCL: tests/support/_dist_pool.py
#                   starts gloo by name with CPU tensors and no variable changes that, so this script is the NCCL check.
#                   With one GPU both processes share it; NCCL refuses that ("Duplicate GPU detected"), which is then
#                   reported as a SKIP line, not a failure.
#   triton     gpu  bench/triton_attention_gpu.py: the Triton flash attention against torch's SDPA (bf16 / fp16 error
#                   against float32, TFLOP/s forward and forward + backward, ring attention on a simulated cp=2 mesh)
#   plan       cpu  python -m funcshard plan <TRAIN_FLAGS> --mesh dp=1 --hardware <key> --json: the prediction of the
#                   step the next part measures (abstract: runs anywhere)
#   train_gpu  gpu  bench/gpu_train_step.py <TRAIN_FLAGS>: the train job's Llama step on one GPU (tokens/s, MFU, peak
#                   memory), beside the plan part's prediction
#   nccl_dry   cpu  without a GPU only: bench/nccl_check.py on gloo and CPU tensors (the script's own check)
#   train_dry  cpu  without a GPU only: bench/gpu_train_step.py --cpu-dry-run (the script's own check, tiny model)
# Then a summary: one line per part (PASS / FAIL / SKIP / TIMEOUT, seconds); exit status 1 when any failed.
#
# Usage:
#   bash bench/gpu_check.sh            # everything (CPU-only machine: ~1 minute, GPU parts skipped)
#   bash bench/gpu_check.sh --dry      # (or GPU_CHECK_DRY=1) list the parts and their commands, run nothing
# Environment: PYTHON (default python: the repository's environment; nothing is installed), GPU_CHECK_OUT (the
# folder for the logs and plan.json; default a fresh temporary one), GPU_CHECK_FLAGS (the model and step flags of
# plan and train_gpu, default below: a 0.4B-parameter Llama, bf16, selective remat, batch 8 x 2048).
set -u
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
read -r -a TRAIN_FLAGS <<<"${GPU_CHECK_FLAGS:---dim 2048 --layers 8 --heads 16 --kv-heads 8 --ffn 5632 --seq 2048 --batch 8 --dtype bf16 --remat selective}"
DRY=${GPU_CHECK_DRY:-0}
for a in "$@"; do
  case "$a" in
    --dry) DRY=1 ;;
    -h | --help) sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $a (--dry, --help)"; exit 2 ;;
  esac
done

# ---------------------------------------------------------------------------------------------- the GPUs
N_SMI=0
SMI="nvidia-smi: not found"
if command -v nvidia-smi >/dev/null 2>&1; then
  N_SMI=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  SMI="nvidia-smi: $N_SMI GPU(s)"
fi
N_TORCH=0
if [ "$DRY" != 1 ]; then
  N_TORCH=$(timeout 60 "$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null | tail -1)
  N_TORCH=${N_TORCH:-0}
fi
GPU=0
if [ "$N_SMI" -gt 0 ] && [ "$N_TORCH" -gt 0 ]; then GPU=1; fi
HW=h100
if [ "$N_SMI" -gt 0 ]; then
  case "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr '[:lower:]' '[:upper:]')" in
    *H200*) HW=h200 ;;
    *H100*) HW=h100 ;;
    *A100*) HW=a100 ;;
  esac
fi
if [ "$DRY" = 1 ]; then
  OUT=${GPU_CHECK_OUT:-"<a temporary folder>"}
else
  OUT=${GPU_CHECK_OUT:-$(mktemp -d -t gpu_check.XXXXXX)}
  mkdir -p "$OUT"
fi

# ---------------------------------------------------------------------------------------------- the parts
# name | gpu or cpu (cpu-nogpu: only where there is no GPU) | timeout (s) | command
PART_NAMES=(env dist_nccl triton plan train_gpu nccl_dry train_dry)
declare -A KIND=([env]=cpu [dist_nccl]=gpu [triton]=gpu [plan]=cpu [train_gpu]=gpu [nccl_dry]=cpu-nogpu [train_dry]=cpu-nogpu)
# (the parts a GPU machine runs: 30 + 90 + 140 + 60 + 150 = 470 s at most)
declare -A LIMIT=([env]=30 [dist_nccl]=90 [triton]=140 [plan]=60 [train_gpu]=150 [nccl_dry]=120 [train_dry]=120)
declare -A CMD=(
  [env]="$PY -c 'import sys, torch; print(\"python\", sys.version.split()[0], \"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"available\", torch.cuda.is_available(), \"devices\", torch.cuda.device_count()); [print(\" \", i, torch.cuda.get_device_name(i)) for i in range(torch.cuda.device_count())]'"
  [dist_nccl]="$PY -m torch.distributed.run --standalone --nproc-per-node 2 bench/nccl_check.py"
  [triton]="$PY bench/triton_attention_gpu.py --iters 10"
  [plan]="$PY -m funcshard plan ${TRAIN_FLAGS[*]} --mesh dp=1 --hardware $HW --json"
  [train_gpu]="$PY bench/gpu_train_step.py ${TRAIN_FLAGS[*]} --hardware $HW --plan-json $OUT/plan.json"
  [nccl_dry]="$PY -m torch.distributed.run --standalone --nproc-per-node 2 bench/nccl_check.py --allow-cpu"
  [train_dry]="$PY bench/gpu_train_step.py --cpu-dry-run"
)

if [ "$DRY" = 1 ]; then
  echo "gpu_check.sh --dry: the parts (kind, timeout, command); nothing is run"
  for p in "${PART_NAMES[@]}"; do
    printf '  %-10s %-10s %4ss  %s\n' "$p" "${KIND[$p]}" "${LIMIT[$p]}" "${CMD[$p]}"
  done
  exit 0
fi

declare -A STATUS SECONDS_OF NOTE
START=$(date +%s)
echo "gpu_check.sh: $SMI, torch sees $N_TORCH CUDA device(s); hardware key $HW; logs in $OUT"

run_part() {  # run_part NAME: the command under `timeout`, its log's tail, the status
  local p=$1 t0 rc log="$OUT/$1.log"
  t0=$(date +%s)
  echo
  echo "=== $p (${KIND[$p]}, timeout ${LIMIT[$p]} s): ${CMD[$p]}"
  timeout -k 10 "${LIMIT[$p]}" bash -c "${CMD[$p]}" >"$log" 2>&1
  rc=$?
  SECONDS_OF[$p]=$(($(date +%s) - t0))
  if [ "$p" = plan ]; then  # (JSON: its summary line is printed below)
    grep -v -E '^W[0-9]{4} |UserWarning|warnings.warn' "$log" | sed '/^{/,$d' | tail -n 10
  else
    grep -v -E '^W[0-9]{4} |UserWarning|warnings.warn' "$log" | tail -n 25
  fi
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    STATUS[$p]=TIMEOUT; NOTE[$p]="killed after ${LIMIT[$p]} s"
  elif [ "$rc" = 0 ]; then
    STATUS[$p]=PASS; NOTE[$p]=""
  else
    STATUS[$p]=FAIL; NOTE[$p]="exit status $rc (log: $log)"
  fi
}

skip() {  # skip NAME WHY: one line
  STATUS[$1]=SKIP; SECONDS_OF[$1]=0; NOTE[$1]=$2
  echo
  echo "SKIP $1: $2"
}

NO_GPU="no GPU ($SMI; torch.cuda.is_available(): $([ "$N_TORCH" -gt 0 ] && echo True || echo False))"
for p in "${PART_NAMES[@]}"; do
  case "${KIND[$p]}" in
    gpu) [ "$GPU" = 1 ] || { skip "$p" "$NO_GPU"; continue; } ;;
    cpu-nogpu) [ "$GPU" = 0 ] || { skip "$p" "a GPU is here: ${p%_dry} runs the real part"; continue; } ;;
  esac
  run_part "$p"
  case "$p" in
    plan)
      # the JSON (the log minus any warning lines before it) for train_gpu; a plan that does not fit exits 1
      sed -n '/^{/,$p' "$OUT/plan.log" >"$OUT/plan.json"
      if [ "${STATUS[plan]}" = FAIL ] && grep -q '"fits": false' "$OUT/plan.json"; then
        STATUS[plan]=PASS; NOTE[plan]="the step does not fit the $HW (see the log)"
      fi
      if SUMMARY=$("$PY" - "$OUT/plan.json" 2>/dev/null <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
step, tps, mfu, peak = d["time_s"]["step"], d["tokens_per_s_per_device"], d["mfu"], d["memory_bytes"]["peak"] / 2**30
print(f"predicted on {d['hardware']}: {step:.3f} s/step, {tps:,.0f} tokens/s, MFU {mfu:.1%}, peak {peak:.1f} GiB")
EOF
      ); then
        NOTE[plan]="${NOTE[plan]:-$SUMMARY}"
        echo "$SUMMARY (JSON: $OUT/plan.json)"
      else
        CMD[train_gpu]="${CMD[train_gpu]% --plan-json*}"  # (train_gpu then runs plan itself)
      fi
      ;;
    dist_nccl)
      if [ "${STATUS[dist_nccl]}" = FAIL ] && grep -q 'Duplicate GPU' "$OUT/dist_nccl.log"; then
        STATUS[dist_nccl]=SKIP
        NOTE[dist_nccl]="NCCL refuses two processes on one GPU (Duplicate GPU detected): needs 2 GPUs, found $N_TORCH"
        echo "SKIP dist_nccl: ${NOTE[dist_nccl]}"
      fi
      ;;
  esac
  if [ "${STATUS[$p]}" = PASS ] && [ -z "${NOTE[$p]}" ]; then  # the part's own one-line result
    NOTE[$p]=$(grep -E '^python |nccl_check: [0-9]+/|^tokens/s|^MFU|FAIL' "$OUT/$p.log" | head -3 | tr -s ' ' | paste -sd ';' -)
  fi
done

echo
echo "=== summary ($(($(date +%s) - START)) s; logs in $OUT)"
FAILED=0
for p in "${PART_NAMES[@]}"; do
  printf '  %-10s %-8s %4s s  %s\n' "$p" "${STATUS[$p]}" "${SECONDS_OF[$p]}" "${NOTE[$p]}"
  case "${STATUS[$p]}" in FAIL | TIMEOUT) FAILED=1 ;; esac
done
exit "$FAILED"
