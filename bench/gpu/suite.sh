#!/usr/bin/env bash
# The GPU suite: everything a lent GPU should measure, in one call of at most 560 s (docs/gpu.md).
#
#   bench/gpu/suite.sh --stage      here, before the calls: the wheels the GPU machine's image lacks
#                                   (.gpu-wheels/) and the SmolLM2 GGUF in two halves (.gpu-model/)
#   bench/gpu/suite.sh --receive    first call (carry .gpu-model/1): keeps that half on the warm machine
#   bench/gpu/suite.sh              second call (carry .gpu-model/2 and .gpu-wheels): the suite
#   bench/gpu/suite.sh --smoke      the same steps on tiny models on the CPU, in CI-sized time (a test)
#   bench/gpu/suite.sh --only rl_step,learner
#                                   setup, models and the steps named: a warm machine's rerun of some
#   bench/gpu/suite.sh --dry-run    each step's command, one a line, run by none (a test loads their configs)
#   bench/gpu/suite.sh --evidence "ARGS"
#                                   second call instead of the suite: setup, models, then
#                                   `python -m bench.evidence ARGS` (pre-registered SmolLM2 runs, docs/evidence.md)
#                                   until the call's time is spent; OUT/evidence.json is the file with the
#                                   runs that finished recorded (copy it over bench/results/evidence.json)
#   bench/gpu/suite.sh --c7 "ARGS"  the same for `python -m bench.time_to_accuracy ARGS` (C7: each cell alone on
#                                   the card; no cell is started that the call's time cannot finish); a
#                                   second call on the warm machine goes on from the first's records
#
# Steps, each with its own time limit inside the suite's deadline, each logged to OUT/<step>.log, its exit
# status to OUT/steps.txt; a step that fails does not stop the others, and the suite's exit status is the
# number of steps that failed:
#   setup    the image's Python environment (its torch) as .venv, with the carried wheels and this project
#   models   SmolLM2-135M-Instruct and its 8-expert upcycle (smoke: a tiny dense Llama and its upcycle)
#   dense    bench/throughput on the dense model, bf16: decode at batch 1/8/32/64 with the plain step
#            and with CUDA graphs, against `generate` and against the step's matmuls (eager and captured),
#            graphs' greedy completions against the eager step's on 64 prompts, the kernels a step launches
#            (and a layer), and (--fused) the same for the static step with compiled bodies
#   rl_step  one RL step of configs/smollm2.yaml against TRL's GRPOTrainer on the same card (TRL
#            generating with transformers: vLLM cannot be installed on these machines), and one more
#            rollout under the profiler: the device's busy time and the gaps between its kernels
#   rl_fused everyprompt's RL step again with the fused paths on (compiled bodies captured in the graphs,
#            compiled learner layers); TRL's figure is rl_step's
#   moe      the decode bench on the 8-expert upcycle
#   learner  one learner update of the recipe profiled (bench/learner/learner_profile.py: its top operators by
#            device time, its host syncs) with torch's layer kernels, then with compiled layers (the
#            first update compiles), then with Liger's kernels
#   test-gpu make test-gpu (pytest -m gpu)
# Results: OUT (default $OUT where the device tool sets it, else bench/results/gpu), one JSON per bench; the
# logs end up in one archive, logs.tar.gz (the device tool brings back at most 8 files a call).
set -uo pipefail
cd "$(dirname "$0")/../.."

SMOKE=0
MODE=run
ONLY=
DRY=0
RESULTS="${OUT:-bench/results/gpu}"
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) SMOKE=1 ;;
    --stage) MODE=stage ;;
    --receive) MODE=receive ;;
    --out) RESULTS="$2"; shift ;;
    --evidence) MODE=evidence; EVIDENCE=(bench.evidence); EVIDENCE_ARGS="$2"; shift ;;
    --c7) MODE=evidence; EVIDENCE=(bench.time_to_accuracy --time-left); EVIDENCE_ARGS="$2"; shift ;;
    --only) ONLY=",$2,"; shift ;;
    --dry-run) DRY=1 ;;
    *) echo "gpu_suite: unknown argument $1 (--smoke, --stage, --receive, --evidence ARGS, --c7 ARGS, --only STEPS," \
         "--dry-run, --out DIR)" >&2
       exit 2 ;;
  esac
  shift
done
PY="${PYTHON:-.venv/bin/python}"

# the wheels the image lacks (docs/gpu.md lists what it has), for its Python 3.12, installed without
# dependency resolution: the image's own packages stand in for the rest
WHEELS="pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 gguf==0.19.0
  trl==1.16.0 datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18 liger-kernel==0.8.5"

if [ "$MODE" = stage ]; then
  rm -rf .gpu-wheels .gpu-model && mkdir -p .gpu-wheels .gpu-model || exit 1
  # shellcheck disable=SC2086
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: --dest .gpu-wheels --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any $WHEELS || exit 1
  make smollm2 >/dev/null || exit 1
  gguf=models/SmolLM2-135M-Instruct.Q4_1.gguf
  half=$(( ($(stat -c %s "$gguf") + 1) / 2 ))
  head -c "$half" "$gguf" > .gpu-model/1 && tail -c +"$((half + 1))" "$gguf" > .gpu-model/2 || exit 1
  du -sh .gpu-wheels .gpu-model/1 .gpu-model/2
  exit 0
fi
if [ "$MODE" = receive ]; then
  exec python3 -m bench.gpu.gpu_models --receive
fi

mkdir -p "$RESULTS/models"
: > "$RESULTS/steps.txt"
# (the smoke's: its steps took 214 s on a 2-core CPU with torch's compile cache cold, 2026-11-28)
BUDGET_S=$([ $SMOKE = 1 ] && echo 360 || echo 560)  # a call's 600 s, less its end
[ "$MODE" = evidence ] && BUDGET_S=$([ $SMOKE = 1 ] && echo 300 || echo 570)  # a call's 600 s, less its end
FAILED=0
BLOCKED_STEPS=" dense rl_step learner rl_fused moe evidence "  # the steps that run on the models' output
BLOCKED_WHY=  # why they cannot run, once the models (or the setup) step failed

step() {  # step NAME LIMIT_S COMMAND...: run it within its limit and what is left of the budget
  local name=$1 limit=$2 rc left
  shift 2
  if [ -n "$ONLY" ] && [[ "$ONLY" != *",$name,"* ]] && [ "$name" != setup ] && [ "$name" != models ]; then
    return
  fi
  if [ "$DRY" = 1 ]; then
    echo "$name: $*"
    return
  fi
  if [ -n "$BLOCKED_WHY" ] && [[ "$BLOCKED_STEPS" == *" $name "* ]]; then
    # a missing GGUF half (the machine was replaced between the two calls) fails every model step: say
    # so once each, in no time, and leave the call's time to the steps that need no model
    echo "$name skipped ($BLOCKED_WHY)" | tee -a "$RESULTS/steps.txt"
    FAILED=$((FAILED + 1))
    return
  fi
  left=$((BUDGET_S - SECONDS))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -le 5 ]; then
    echo "$name skipped (the suite's $BUDGET_S s were spent)" | tee -a "$RESULTS/steps.txt"
    FAILED=$((FAILED + 1))
    return
  fi
  local began=$SECONDS
  # through bash, so that a step may be one of this script's (exported) functions
  timeout --kill-after=10 "$limit" bash -c '"$@"' "$name" "$@" > "$RESULTS/$name.log" 2>&1
  rc=$?
  echo "$name exit $rc in $((SECONDS - began)) s (limit $limit s)" | tee -a "$RESULTS/steps.txt"
  tail -n 8 "$RESULTS/$name.log" | sed "s/^/  $name| /"
  [ "$rc" -ne 0 ] && FAILED=$((FAILED + 1))
}

passed() {  # passed NAME: the step ran and exited 0 (a dry run runs nothing and fails nothing)
  [ "$DRY" = 1 ] || grep -q "^$1 exit 0 " "$RESULTS/steps.txt"
}

finish() {  # finish MESSAGE: the logs packed, MESSAGE said, the number of failed steps as the exit status
  [ "$DRY" = 1 ] && { echo "gpu_suite: a dry run (nothing ran)"; exit 0; }
  pack
  echo "gpu_suite: $1"
  exit "$FAILED"
}

pack() {  # the logs as one archive: the device tool brings back at most 8 files from a call
  local logs=("$RESULTS"/*.log)
  [ -e "${logs[0]}" ] || return 0
  tar -czf "$RESULTS/logs.tar.gz" -C "$RESULTS" "${logs[@]##*/}" && rm -f "${logs[@]}"
  rmdir "$RESULTS/models" 2>/dev/null
  return 0
}

setup() {
  # the image's own Python environment (a venv holding its torch) is the one to use: .venv points at it,
  # so that make's targets run there; the carried wheels and this project go into it (the machine is bare
  # at each start and given back after)
  set -e
  local prefix
  prefix=$(python3 -c 'import sys; print(sys.prefix)')
  # a .venv left by an earlier call is kept only if it holds the image's torch (make makes an empty one)
  if [ -e .venv ] && ! .venv/bin/python -c "import torch" 2>/dev/null; then rm -rf .venv; fi
  [ -e .venv ] || ln -s "$prefix" .venv
  # shellcheck disable=SC2086
  .venv/bin/python -m pip install --quiet --no-index --no-deps --find-links .gpu-wheels $WHEELS
  .venv/bin/python -m pip install --quiet --no-index --no-deps --no-build-isolation -e .
  touch .venv/.installed  # make's stamp: the environment is ready (make test-gpu uses it as it is)
  .venv/bin/python -c "import everyprompt, trl, datasets, math_verify, gguf, pydantic, torch, transformers
print('torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__,
      'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))"
}

export -f setup
export WHEELS
if [ $SMOKE = 1 ]; then
  DEVICE=cpu DTYPE=fp32 QUICK=--quick CONFIG=configs/demo.yaml STEPS=2 UPDATES=1 FUSED=
  RECIPE=(--set sft.steps=0 --set rollout.precision=fp32)  # the demo recipe without its SFT warm start
  LEARNER=("${RECIPE[@]}" --kernels compiled,liger)  # on the CPU the liger profile is skipped, saying why
  # the fused RL step's settings where there are no graphs to capture: the static step, compiled
  FUSED_RL=(--set rollout.compile=on --set rollout.cuda_graphs=static --set model.kernels=compiled)
  MODELS_ARGS="--smoke $RESULTS/models"
  TEST_GPU=("$PY" -m pytest -q -m gpu -rs -p no:cacheprovider tests/gpu)
  MOE_BATCHES=
  if "$PY" -c "import trl" 2>/dev/null; then TRAINERS=everyprompt,trl; else TRAINERS=everyprompt; fi
else
  # the image's Python is the one this mode installs into (and make's targets then use): on any other
  # machine that would be the host's own Python, so it runs only where that Python sees a GPU
  if [ "$DRY" = 0 ] && ! python3 -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    echo "gpu_suite: python3 here sees no CUDA device; this mode sets up a lent GPU machine's image" \
      "(use --smoke on a CPU, or --dry-run to see the steps)" >&2
    exit 2
  fi
  step setup 90 setup
  if ! passed setup; then
    BLOCKED_WHY="the setup step failed"
    BLOCKED_STEPS=" models dense rl_step learner rl_fused moe evidence test-gpu "
  fi
  # FUSED: the dense step also times and counts the static step with compiled bodies (Inductor's kernels
  # captured), to decide by measurement whether compile=on should go with graphs by default
  DEVICE=cuda DTYPE=bf16 QUICK= CONFIG=configs/smollm2.yaml STEPS=6 UPDATES=3 FUSED=--fused
  # the recipe as it is: rl_step matches TRL's arithmetic itself (a bf16 engine, the old policy's log-probs
  # recomputed), and the profiled update is that step's update
  RECIPE=()
  LEARNER=(--set rollout.precision=bf16 --set rl.old_logprobs=recompute --kernels compiled,liger)
  # the RL step with every fused path on: compiled bodies in the graphs, compiled learner layers
  FUSED_RL=(--set rollout.compile=on --set rollout.cuda_graphs=on --set model.kernels=compiled)
  MODELS_ARGS=
  TEST_GPU=(make test-gpu)
  TRAINERS=everyprompt,trl
  MOE_BATCHES="--batches 1,64"  # the upcycle's target is at batch 64: the suite's 560 s hold every step then
fi
[ "$TRAINERS" = everyprompt ] && echo "rl_step: TRL is not installed here; everyprompt's steps alone" \
  | tee -a "$RESULTS/steps.txt"

# the upcycle only for a call that runs the MoE bench (writing it takes a while)
if [ "$MODE" = evidence ] || { [ -n "$ONLY" ] && [[ "$ONLY" != *",moe,"* ]]; }; then
  MODELS_ARGS="$MODELS_ARGS --dense-only"
fi
step models 120 "$PY" -m bench.gpu.gpu_models $MODELS_ARGS
if [ -z "$BLOCKED_WHY" ] && ! passed models; then
  BLOCKED_WHY="the models step failed: $(tail -n 1 "$RESULTS/models.log" 2>/dev/null)"
fi
if [ "$MODE" = evidence ]; then
  # the runs the machine has time for: the bench records each finished cell, and on the time limit's
  # SIGTERM it stops its cells (they checkpoint) and saves what finished. It works in a folder of the
  # checkout, so that the records name runs relative to it ($OUT lies outside), starting from the carried
  # evidence file; the folder stays while the machine is warm, so a later call reuses the teacher and the
  # same command continues stopped cells (once the machine is given back they are lost). Its files are
  # copied into $RESULTS.
  # An earlier call's file on this warm machine is kept, the carried one's runs merged into it.
  work=bench/results/gpu-evidence
  if [ "$DRY" = 1 ]; then
    :
  elif [ -f "$work/evidence.json" ]; then
    "$PY" -m bench.evidence --out "$work" --merge bench/results/evidence.json || FAILED=$((FAILED + 1))
  else
    mkdir -p "$work" && cp bench/results/evidence.json "$work/evidence.json"
  fi
  limit=$((BUDGET_S - SECONDS - 5))
  # C7's runner is told the time it has (--time-left), the evidence bench is stopped at it
  [ "${EVIDENCE[1]:-}" = --time-left ] && EVIDENCE+=("$((limit - 15))")
  # shellcheck disable=SC2086
  step evidence "$limit" "$PY" -m "${EVIDENCE[@]}" $EVIDENCE_ARGS --out "$work"
  cp "$work"/evidence*.json "$RESULTS/"
  finish "evidence in $RESULTS/evidence.json ($SECONDS s)"
fi
made() {  # made KIND: the model directory the models step printed as `KIND PATH`
  sed -n "s/^$1 //p" "$RESULTS/models.log" 2>/dev/null | tail -n 1
}
DENSE_MODEL=$(made dense) MOE_MODEL=$(made moe)
# (unprinted only in a dry run: the model steps of a failed models step do not run)
DENSE_MODEL=${DENSE_MODEL:-models/smollm2-135m-instruct} MOE_MODEL=${MOE_MODEL:-models/smollm2-moe8}
BENCH=("$PY" -m bench.throughput --device "$DEVICE" --dtype "$DTYPE" --graphs --decode-only $QUICK --out "$RESULTS")
# in the order of what matters most when the budget runs out (measured on an H200: setup 20 s, models 62,
# dense 88 without --fused, test-gpu 24; moe ran past 120 s; rl_step 160 s with TRL's six steps)
step rl_step 240 "$PY" -m bench.learner.rl_step --model "$DENSE_MODEL" --config "$CONFIG" --steps "$STEPS" \
  --trainers "$TRAINERS" "${RECIPE[@]}" --out "$RESULTS"
# shellcheck disable=SC2086
step dense 220 "${BENCH[@]}" $FUSED --model "$DENSE_MODEL"
# (transformers' own attention, cuDNN's included, no longer: its plan per new width was measured on the
# third H200, docs/gpu-runs.md; `--attention default,with-cudnn` profiles it again)
step learner 200 "$PY" -m bench.learner.learner_profile --model "$DENSE_MODEL" --config "$CONFIG" --updates "$UPDATES" \
  "${LEARNER[@]}" --out "$RESULTS"
# everyprompt's RL step again with the fused paths (TRL's figure is the rl_step step's, same card)
step rl_fused 200 "$PY" -m bench.learner.rl_step --model "$DENSE_MODEL" --config "$CONFIG" --steps "$STEPS" \
  --trainers everyprompt "${RECIPE[@]}" "${FUSED_RL[@]}" --tag fused --out "$RESULTS"
step test-gpu 180 "${TEST_GPU[@]}"  # 63 s on the H200 before the compiled layers' test (Triton compiles)
# shellcheck disable=SC2086
step moe 180 "${BENCH[@]}" $MOE_BATCHES --model "$MOE_MODEL"

finish "$FAILED step(s) failed; results in $RESULTS ($SECONDS s)"
