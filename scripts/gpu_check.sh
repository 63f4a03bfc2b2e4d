#!/usr/bin/env bash
# gpu_check.sh: check the course on a machine with an NVIDIA GPU, in one command.
#
#   bash scripts/gpu_check.sh [--dry-run] [--wheels DIR] [--out DIR] [--timeout-s N]
#                             [--bundle] [--all-tests] [--with-launch] [--notebooks GLOB]
#                             [--parallel N] [--only STEPS] [--notebook-timeout-s N]
#                             [--notebook-dir DIR]
#
# Steps, in this order; every step runs (a failure does not stop the next one) under its
# own `timeout`, clamped to what is left of the whole run's budget (--timeout-s, 520 s):
#   wheels        (only with --wheels DIR) scripts/install_wheels.py: the packages this
#                 machine lacks, offline, into a private folder on PYTHONPATH (never torch)
#   env           OUT/env.json: nvidia-smi -q, torch/CUDA/cuDNN/NCCL versions, labkit's tier
#   gpu-tests     pytest -m gpu over the test files that use the gpu marker
#   record-trace  (not with --dry-run) notebook 01's training run recorded from NVML into
#                 OUT/traces/, to be checked in under labkit/metrics/traces/
#   record-profile  notebook 06's step profiled on the GPU (python -m labkit record-profile)
#                 into OUT/profiles/<gpu>-nb06-<date>/, to be checked in under
#                 labkit/recordings/profiles/; with --dry-run the same path on the CPU at smoke
#                 size, into a temporary folder, which passes when the loader refuses it for
#                 want of GPU kernels (a CPU trace is never a recording)
#   all-tests     (only with --all-tests) the whole test suite
#   bench-gpu-throughput, bench-train-step, bench-sampler, bench-precision   benchmarks/ on the GPU, JSON into OUT/
#   recordings    python -m labkit recordings build OUT/bench_*.json --out OUT/recordings: the
#                 key GPU figures that ship in labkit/recordings/; with --dry-run the
#                 benchmarks wrote CPU results, and the step passes only when the builder
#                 refuses them for being a CPU run
#   notebook:NAME each solutions/NN_*.ipynb through papermill at size="gpu" into OUT/notebooks/,
#                 the longest first (NB_FIRST below), listed in the summary in name order
#   bench-launch  (only with --dry-run or --with-launch) benchmarks/bench_launch.py: 2 ranks
#                 over gloo, the launcher and not the GPU, so a short GPU session skips it
# Then OUT/summary.json lists every step (status, exit code, seconds, timeout) and the
# script exits 0 if every step passed, 1 if any failed, 2 if it cannot run here at all.
#
# It uses the torch it finds ($PYTHON, else python3) and never installs torch or reaches the
# network. labkit is used from this checkout through PYTHONPATH: nothing is installed for it.
# A machine without papermill (or another test dependency) gets it from a wheel folder made
# elsewhere (see benchmarks/README.md, "GPU check").
#
#   --dry-run       the same steps on the CPU at smoke size (no GPU needed; CUDA hidden):
#                   exercises the script itself, measures nothing about a GPU
#   --wheels DIR    offline wheel folder for packages missing here (papermill, nbformat, ...)
#   --out DIR       where results go (default results/gpu-<UTC date-time>/, git-ignored)
#   --timeout-s N   budget for the whole run, seconds (default 520, wheels included: the run
#                   then ends within 9 minutes; 300 with --dry-run)
#   --bundle        at the end, pack everything but summary.json into OUT/gpu_check.tar.gz
#                   (two files to carry back instead of one per notebook)
#   --all-tests     also run the whole CPU test suite (slow: raise --timeout-s)
#   --with-launch   also run bench-launch on a GPU machine
#   --notebooks G   only the solutions matching glob G (default "[0-9][0-9]*_*.ipynb")
#   --notebook-dir DIR  take the notebooks from DIR instead of solutions/ (the tests run the
#                   notebook step on two tiny notebooks: the course's own run in test_notebooks)
#   --parallel N    run up to N notebooks at once (default on a one-GPU machine: one per 4
#                   CPU cores, 2 to 4; else 1): on one GPU the multi-process labs run their
#                   ranks on the CPU, so four notebooks share a 16-core machine well, and one
#                   short run covers them all (benchmarks/README.md, "time budget")
#   --notebook-timeout-s N  one notebook's limit, seconds (default 240)
#   --only STEPS    only these step groups, comma-separated, from gpu-tests, record-trace,
#                   record-profile, benchmarks (with recordings), notebooks, bench-launch (env
#                   always runs): two invocations with disjoint groups can share one device
#                   session side by side
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
DRY=0
WHEELS=""
OUT=""
BUDGET=""
BUNDLE=0
ALL_TESTS=0
WITH_LAUNCH=0
NB_GLOB='[0-9][0-9]*_*.ipynb'
PARALLEL=""
ONLY=""
NB_TIMEOUT=240

usage() { sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }
die() { echo "gpu_check: $*" >&2; exit 2; }

while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --wheels) [ $# -ge 2 ] || die "--wheels needs a folder"; WHEELS=$2; shift ;;
    --out) [ $# -ge 2 ] || die "--out needs a folder"; OUT=$2; shift ;;
    --timeout-s) [ $# -ge 2 ] || die "--timeout-s needs a number of seconds"; BUDGET=$2; shift ;;
    --bundle) BUNDLE=1 ;;
    --all-tests) ALL_TESTS=1 ;;
    --with-launch) WITH_LAUNCH=1 ;;
    --notebooks) [ $# -ge 2 ] || die "--notebooks needs a glob"; NB_GLOB=$2; shift ;;
    --notebook-dir) [ $# -ge 2 ] || die "--notebook-dir needs a folder"; NB_SRC=$2; shift ;;
    --parallel) [ $# -ge 2 ] || die "--parallel needs a number"; PARALLEL=$2; shift ;;
    --notebook-timeout-s) [ $# -ge 2 ] || die "--notebook-timeout-s needs seconds"; NB_TIMEOUT=$2; shift ;;
    --only) [ $# -ge 2 ] || die "--only needs step groups"; ONLY=$2; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
  shift
done

if [ -z "$BUDGET" ]; then
  if [ "$DRY" = 1 ]; then BUDGET=300; else BUDGET=520; fi
fi
case "$BUDGET" in
  ''|*[!0-9]*) die "--timeout-s=$BUDGET is not allowed: a whole number of seconds, e.g. 520" ;;
esac
case "$NB_TIMEOUT" in
  ''|*[!0-9]*) die "--notebook-timeout-s=$NB_TIMEOUT is not allowed: a whole number of seconds" ;;
esac
case "$PARALLEL" in
  ''|[1-9]|[1-9][0-9]) ;;
  *) die "--parallel=$PARALLEL is not allowed: a whole number of notebooks >= 1" ;;
esac
GROUPS_KNOWN="gpu-tests record-trace record-profile benchmarks notebooks bench-launch"
for g in ${ONLY//,/ }; do
  case " $GROUPS_KNOWN " in
    *" $g "*) ;;
    *) die "--only $g is not a step group: choose from ${GROUPS_KNOWN// /, }" ;;
  esac
done
# wanted GROUP: true when --only is unset or names GROUP
wanted() { [ -z "$ONLY" ] || case ",$ONLY," in *",$1,"*) true ;; *) false ;; esac; }
[ -z "$WHEELS" ] || [ -d "$WHEELS" ] || die "--wheels $WHEELS: no such folder"
command -v timeout >/dev/null || die "coreutils 'timeout' is missing: every step needs it"
command -v "$PY" >/dev/null || die "no '$PY' on PATH: set PYTHON=/path/to/python (with torch)"

# --- can this machine run the GPU tier? --------------------------------------------------------

export LC_NUMERIC=C  # EPOCHREALTIME with a decimal point, whatever the locale
TORCH_INFO=$("$PY" -c 'import torch; print(torch.__version__, torch.cuda.is_available())' \
  2>/dev/null) || die "'$PY' cannot import torch: set PYTHON to the python that has torch"
if [ "$DRY" = 1 ]; then
  MODE="dry-run (CPU)"
  SIZE=smoke
  export CUDA_VISIBLE_DEVICES=""  # a CPU dry run even where a GPU exists
else
  MODE="gpu"
  SIZE=gpu
  if [ "${TORCH_INFO##* }" != "True" ]; then
    SMI=""
    if command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
      SMI=" (nvidia-smi lists a GPU, but torch ${TORCH_INFO% *} cannot use it: a CPU build?)"
    fi
    echo "gpu_check: no NVIDIA GPU found (nvidia-smi / torch.cuda)$SMI;" \
      "use --dry-run to exercise the script on CPU" >&2
    exit 2
  fi
fi
if [ -z "$PARALLEL" ]; then
  # Several notebooks at once only on one GPU, where the multi-process labs put their ranks on
  # the CPU: one per 4 cores, 2 to 4 (a CPU-rank lab keeps 2-3 cores busy). With several GPUs a
  # notebook's job takes them all, and two at once would share them.
  PARALLEL=1
  if [ "$DRY" = 0 ] && [ "$("$PY" -c 'import torch; print(torch.cuda.device_count())')" = 1 ]; then
    CORES=$(nproc 2>/dev/null || echo 8)
    PARALLEL=$((CORES / 4))
    [ "$PARALLEL" -ge 2 ] || PARALLEL=2
    [ "$PARALLEL" -le 4 ] || PARALLEL=4
  fi
fi

# --- output, private folders, environment ------------------------------------------------------

OUT=${OUT:-$ROOT/results/gpu-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT/notebooks" || die "cannot create $OUT"
OUT=$(cd "$OUT" && pwd)
LOG=$OUT/gpu_check.log
: >"$LOG"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/labkit-gpu-check.XXXXXX") || die "mktemp failed"
trap 'rm -rf "$WORK"' EXIT
STEPS=$WORK/steps.jsonl
: >"$STEPS"

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # labkit from this checkout, no install
export LABKIT_HOME=$WORK/labkit-home                  # job registry and runs: thrown away
export LABKIT_SIZE=$SIZE
export PYTHONUNBUFFERED=1
export PYTHONDONTWRITEBYTECODE=1
# A set MPLBACKEND stops ipykernel from choosing its inline backend, and every plt.show()
# figure would vanish from the executed notebooks; headless scripts pick Agg by themselves.
unset MPLBACKEND
# Jupyter, IPython and matplotlib write caches under HOME, which a container may not allow.
export JUPYTER_RUNTIME_DIR=$WORK/jupyter-runtime IPYTHONDIR=$WORK/ipython MPLCONFIGDIR=$WORK/mpl
START=$(date +%s)
cd "$ROOT" || die "cannot cd to $ROOT"

say() { echo "$*" | tee -a "$LOG"; }

# record NAME STATUS EXIT_CODE T0 T1 TIMEOUT NOTE [COMMAND...]: one line of steps.jsonl
record() {
  "$PY" - "$STEPS" "$@" <<'EOF'
import json, sys
path, name, status, code, t0, t1, limit, note, *cmd = sys.argv[1:]
with open(path, "a") as f:
    f.write(json.dumps({
        "name": name, "status": status, "exit_code": int(code) if code else None,
        "duration_s": round(float(t1) - float(t0), 2) if t0 and t1 else 0.0,
        "timeout_s": int(limit) if limit else None, "note": note or None,
        "command": " ".join(cmd) or None,
    }) + "\n")
EOF
}

now() { echo "${EPOCHREALTIME:-$(date +%s)}"; }

# limit_for CAP_S: the seconds a step starting now may take: its cap, or what is left.
limit_for() {
  local left=$((BUDGET - ($(date +%s) - START)))
  echo $(($1 < left ? $1 : left))
}

# not_run NAME COMMAND...: a step the budget left no time for
not_run() {
  local name=$1
  shift
  say "=== $name: not run, the time budget (--timeout-s $BUDGET) is spent"
  record "$name" not-run "" "" "" "" "time budget of $BUDGET s spent before this step" "$@"
}

# step NAME CAP_S NOTE -- COMMAND...: run COMMAND under a timeout; never stops the script.
step() {
  local name=$1 cap=$2 note=$3
  shift 4
  local limit
  limit=$(limit_for "$cap")
  if [ "$limit" -lt 5 ]; then
    not_run "$name" "$@"
    return
  fi
  say "=== $name (timeout ${limit}s): $*"
  local t0 t1 rc
  t0=$(now)
  timeout --kill-after=10 "$limit" "$@" </dev/null 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  t1=$(now)
  finish "$name" "$rc" "$t0" "$t1" "$limit" "$note" "$@"
}

# finish NAME RC T0 T1 LIMIT NOTE COMMAND...: the step's status from its exit code, recorded
finish() {
  local name=$1 rc=$2 t0=$3 t1=$4 limit=$5 note=$6 status
  shift 6
  case "$rc" in
    0) status=ok ;;
    124|137) status=timeout; note="${note:+$note; }killed after ${limit}s" ;;
    *) status=failed ;;
  esac
  if [ "$name" = gpu-tests ] && [ "$rc" = 5 ]; then
    status=ok; note="no test selected by -m gpu"  # pytest: nothing collected is not a failure
  fi
  say "=== $name: $status (exit $rc)"
  record "$name" "$status" "$rc" "$t0" "$t1" "$limit" "$note" "$@"
}

# skip NAME STATUS NOTE: a step that cannot run here, with the reason
skip() {
  say "=== $1: $2 ($3)"
  record "$1" "$2" "" "" "" "" "$3"
}

# refusal_step NAME CAP_S EXPECTED NOTE -- COMMAND...: a dry run's step whose pass is a
# refusal: COMMAND must exit non-zero and print EXPECTED; exit 0, or another failure, fails it.
refusal_step() {
  local name=$1 cap=$2 expected=$3 note=$4
  shift 5
  local limit
  limit=$(limit_for "$cap")
  if [ "$limit" -lt 5 ]; then
    not_run "$name" "$@"
    return
  fi
  say "=== $name (timeout ${limit}s, must refuse: $expected): $*"
  local t0 t1 rc
  t0=$(now)
  timeout --kill-after=10 "$limit" "$@" </dev/null >"$WORK/$name.out" 2>&1
  rc=$?
  t1=$(now)
  tee -a "$LOG" <"$WORK/$name.out"
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    finish "$name" "$rc" "$t0" "$t1" "$limit" "$note" "$@"
  elif [ "$rc" != 0 ] && grep -qF -- "$expected" "$WORK/$name.out"; then
    say "=== $name: ok (refused as expected, exit $rc)"
    record "$name" ok "$rc" "$t0" "$t1" "$limit" "$note" "$@"
  else
    say "=== $name: failed (exit $rc, expected a refusal naming: $expected)"
    record "$name" failed "$rc" "$t0" "$t1" "$limit" \
      "expected a refusal naming: $expected" "$@"
  fi
}

say "gpu_check: mode=$MODE python=$PY torch=${TORCH_INFO% *} out=$OUT budget=${BUDGET}s"

# --- wheels ------------------------------------------------------------------------------------

# Packages the image lacks, from the wheel folder: scripts/install_wheels.py says which it
# installs (never the image's torch stack, nothing the image already has) and why.
if [ -n "$WHEELS" ]; then
  SITE=$WORK/site
  if ! find "$WHEELS" -maxdepth 1 -name '*.whl' | grep -q .; then
    skip wheels failed "no .whl files in $WHEELS"
  else
    step wheels 120 "missing packages into a private folder on PYTHONPATH" -- \
      "$PY" "$ROOT/scripts/install_wheels.py" "$WHEELS" "$SITE"
    export PYTHONPATH="$SITE:$PYTHONPATH"  # ahead of site-packages: nvidia-ml-py must win
  fi
fi

# --- environment report ------------------------------------------------------------------------

cat >"$WORK/env_report.py" <<'EOF'
"""Versions, GPUs and labkit's tier, as JSON. No hostname."""
import dataclasses, datetime, importlib.metadata as md, json, platform, shutil, subprocess, sys

import torch

from labkit import hardware

out, mode = sys.argv[1], sys.argv[2]


def smi(*args):
    if not shutil.which("nvidia-smi"):
        return None
    try:
        p = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=60)
        return p.stdout if p.returncode == 0 else f"exit {p.returncode}: {p.stderr.strip()}"
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"nvidia-smi failed: {e}"


def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


cuda = torch.cuda.is_available()
gpus = []
for i in range(torch.cuda.device_count() if cuda else 0):
    p = torch.cuda.get_device_properties(i)
    gpus.append({"index": i, "name": p.name, "memory_bytes": p.total_memory,
                 "compute_capability": f"{p.major}.{p.minor}",
                 "multiprocessors": p.multi_processor_count})
nccl = None
if cuda:
    try:
        v = torch.cuda.nccl.version()  # a tuple on recent torch, an int on older ones
        nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception as e:
        nccl = f"N/A ({type(e).__name__})"
tier = hardware.describe_tier()
report = {
    "mode": mode,
    "date": datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat(),
    "python": {"version": platform.python_version(), "executable": sys.executable},
    "torch": {"version": torch.__version__, "cuda": torch.version.cuda,
              "cudnn": torch.backends.cudnn.version() if cuda else None, "nccl": nccl,
              "cuda_available": cuda, "gpus": gpus, "threads": torch.get_num_threads()},
    "tier": tier.tier,
    "tier_info": dataclasses.asdict(tier),
    "nvml": hardware.nvml_status().message,
    "cpu": str(hardware.cpu_info()),
    "packages": {n: version(n) for n in ("labkit", "numpy", "matplotlib", "psutil",
                                         "nvidia-ml-py", "pytest", "papermill", "nbformat",
                                         "nbclient", "ipykernel", "ipywidgets")},
    "nvidia_smi_q": smi("-q"),
}
with open(out, "w") as f:
    json.dump(report, f, indent=2, default=str)
print(f"tier={tier.tier}; torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}; "
      f"GPUs: {[g['name'] for g in gpus] or 'none'}")
print(f"environment report written to {out}")
EOF
step env 90 "" -- "$PY" "$WORK/env_report.py" "$OUT/env.json" "$MODE"

# --- tests ---------------------------------------------------------------------------------------

if wanted gpu-tests; then
  # addopts cleared: the project's defaults name nbval flags, and nbval may be missing here.
  PYTEST=("$PY" -m pytest -o addopts=-ra -p no:cacheprovider --rootdir "$ROOT")
  mapfile -t GPU_TEST_FILES < <(grep -l 'mark\.gpu' "$ROOT"/tests/test_*.py 2>/dev/null)
  if [ "${#GPU_TEST_FILES[@]}" -eq 0 ]; then
    skip gpu-tests skipped "no test file uses @pytest.mark.gpu"
  else
    step gpu-tests 150 "${#GPU_TEST_FILES[@]} file(s) with gpu tests" -- \
      "${PYTEST[@]}" -m gpu "${GPU_TEST_FILES[@]}"
fi
if [ "$ALL_TESTS" = 1 ]; then
  step all-tests "$BUDGET" "the whole suite" -- "${PYTEST[@]}" "$ROOT/tests"
fi
fi

# --- a recording of notebook 01's training run, for learners without a GPU -------------------------

if wanted record-trace; then
  if [ "$DRY" = 1 ]; then
    skip record-trace skipped "a recording holds real NVML readings: GPU machines only"
  else
    step record-trace 150 "notebook 01's run at size=gpu; check the .png, then commit the trace" -- \
      "$PY" -m labkit record-trace --out "$OUT/traces/nb01-train-$(date -u +%Y%m%d).jsonl" \
      --steps 1000 --period-s 0.25  # ~17-34 s on an H100/H200; 300 steps were too short to show much
fi
fi

# --- a profile of notebook 06's step, for learners without a GPU --------------------------------

if wanted record-profile; then
  if [ "$DRY" = 1 ]; then
    # The whole path on the CPU; its output is refused as a recording, so it stays out of OUT.
    step record-profile 90 "dry run: CPU, smoke size; the loader's refusal (no GPU kernels) is the pass" -- \
      "$PY" -m labkit record-profile --device cpu --active 1 --out "$WORK/profile-dry-run"
  else
    GPU_SLUG=$("$PY" -c 'import re, torch; print(re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(0).lower()).strip("-"))' 2>/dev/null || echo gpu)
    step record-profile 90 "notebook 06's step at size=gpu; check it, then commit the folder under labkit/recordings/profiles/" -- \
      "$PY" -m labkit record-profile \
      --out "$OUT/profiles/$GPU_SLUG-nb06-$(date -u +%Y-%m-%d)" \
      --conditions "alone on the GPU: scripts/gpu_check.sh runs this step before the benchmarks and notebooks"
  fi
fi

# --- benchmarks on the GPU ---------------------------------------------------------------------

if wanted benchmarks; then
  if [ "$DRY" = 1 ]; then
    TP_ARGS=(--allow-cpu --warmup 1 --steps 3)
    TS_ARGS=(--size smoke --rounds 3 --warmup 1)
    SA_ARGS=(--size smoke --rounds 1 --warmup 0 --block-s 0.3)
    PR_ARGS=(--rounds 2 --warmup 1)
    LA_ARGS=(--rounds 1 --warmup 0)
  else
    TP_ARGS=()
    TS_ARGS=(--size gpu)
    SA_ARGS=(--size gpu --rounds 4)
    PR_ARGS=(--size gpu)
    LA_ARGS=()
fi
step bench-gpu-throughput 120 "" -- \
  "$PY" -m benchmarks.bench_gpu_throughput "${TP_ARGS[@]}" --out "$OUT/bench_gpu_throughput.json"
step bench-train-step 120 "" -- \
  "$PY" -m benchmarks.bench_train_step "${TS_ARGS[@]}" --out "$OUT/bench_train_step.json"
step bench-sampler 90 "" -- \
  "$PY" -m benchmarks.bench_sampler "${SA_ARGS[@]}" --out "$OUT/bench_sampler.json"
step bench-precision 120 "" -- \
  "$PY" -m benchmarks.bench_precision "${PR_ARGS[@]}" --out "$OUT/bench_precision.json"

# The recordings that ship, built from these results (labkit/recordings/build.py).
mapfile -t BENCH_FILES < <(find "$OUT" -maxdepth 1 -name 'bench_*.json' | sort)
if [ "$(limit_for 60)" -lt 5 ]; then
  not_run recordings "$PY" -m labkit recordings build
elif [ "${#BENCH_FILES[@]}" -eq 0 ]; then
  # the benchmark steps above failed, and say why: nothing to build from
  skip recordings skipped "no benchmark result in $OUT to build recordings from"
elif [ "$DRY" = 1 ]; then
  # CPU results: the builder must refuse them (a recording holds GPU measurements only).
  refusal_step recordings 60 "a CPU run (device 'cpu'); a recording holds figures measured on a GPU" \
    "dry run: the builder refused the CPU results, as it must" -- \
    "$PY" -m labkit recordings build "${BENCH_FILES[@]}" --out "$WORK/recordings-dry-run"
else
  step recordings 60 "check them, then commit into labkit/recordings/ (and benchmarks/results/)" -- \
    "$PY" -m labkit recordings build "${BENCH_FILES[@]}" --out "$OUT/recordings"
fi
fi

# --- notebooks -----------------------------------------------------------------------------------

if wanted notebooks; then
  NB_SRC=$(cd "${NB_SRC:-$ROOT/solutions}" 2>/dev/null && pwd) || die "--notebook-dir: no such folder"
  mapfile -t NOTEBOOKS < <(find "$NB_SRC" -maxdepth 1 -name "$NB_GLOB" | sort)
  if [ "${#NOTEBOOKS[@]}" -eq 0 ]; then
    skip notebooks failed "no notebook in $NB_SRC matches '$NB_GLOB'"
  elif ! "$PY" -c 'import papermill' >/dev/null 2>&1; then
    for nb in "${NOTEBOOKS[@]}"; do
      skip "notebook:$(basename "$nb" .ipynb)" failed \
        "papermill is not importable: pass --wheels DIR with papermill and its dependencies"
    done
  else
    # Up to $PARALLEL at a time, each under its own timeout; each one's output goes to its own
    # log, appended to the main log in notebook order once all have ended.
    NB_DIR=$WORK/notebook-steps
    mkdir -p "$NB_DIR"
    # Started longest first (their modelled time at size "gpu" on one GPU, benchmarks/README.md
    # "time budget"), so that no long notebook starts last; the rest in name order.
    NB_FIRST="05 02 04 06 03 03b 03c 02b 07 01 03d 00"
    STARTS=()
    for id in $NB_FIRST; do
      for nb in "${NOTEBOOKS[@]}"; do
        case "$(basename "$nb")" in "${id}_"*) STARTS+=("$nb") ;; esac
      done
    done
    for nb in "${NOTEBOOKS[@]}"; do
      case " ${STARTS[*]} " in *" $nb "*) ;; *) STARTS+=("$nb") ;; esac
    done
    nb_cmd() {  # nb_cmd NOTEBOOK: the papermill command, into the array CMD
      CMD=("$PY" -m papermill "$1" "$OUT/notebooks/$(basename "$1")" -p size "$SIZE"
           --cwd "$NB_SRC" -k python3 --execution-timeout 300 --no-progress-bar)
    }
    for nb in "${STARTS[@]}"; do
      while [ "$(jobs -rp | wc -l)" -ge "$PARALLEL" ]; do wait -n; done
      name=$(basename "$nb" .ipynb)
      limit=$(limit_for "$NB_TIMEOUT")
      if [ "$limit" -lt 5 ]; then
        : >"$NB_DIR/$name.not-run"
        continue
      fi
      nb_cmd "$nb"
      say "=== notebook:$name started (timeout ${limit}s): ${CMD[*]}"
      echo "$(now) $limit" >"$NB_DIR/$name.start"
      (
        timeout --kill-after=10 "$limit" "${CMD[@]}" </dev/null >"$NB_DIR/$name.log" 2>&1
        echo "$? $(now)" >"$NB_DIR/$name.end"
      ) &
    done
    wait
    for nb in "${NOTEBOOKS[@]}"; do
      name=$(basename "$nb" .ipynb)
      nb_cmd "$nb"
      if [ -e "$NB_DIR/$name.not-run" ]; then
        not_run "notebook:$name" "${CMD[@]}"
        continue
      fi
      read -r t0 limit <"$NB_DIR/$name.start"
      read -r rc t1 <"$NB_DIR/$name.end"
      say "=== notebook:$name output:"
      tee -a "$LOG" <"$NB_DIR/$name.log"
      finish "notebook:$name" "$rc" "$t0" "$t1" "$limit" "size=$SIZE" "${CMD[@]}"
    done
fi
fi

# --- the launcher --------------------------------------------------------------------------------

if wanted bench-launch; then
  if [ "$DRY" = 1 ] || [ "$WITH_LAUNCH" = 1 ]; then
    step bench-launch 150 "2 ranks over gloo on the CPU" -- \
      "$PY" -m benchmarks.bench_launch "${LA_ARGS[@]}" --out "$OUT/bench_launch.json"
  else
    skip bench-launch skipped "the CPU launcher, measured on CPU machines; --with-launch runs it"
fi
fi

# --- summary -------------------------------------------------------------------------------------

END=$(date +%s)
if [ "$BUNDLE" = 1 ]; then
  BUNDLE_FILE=gpu_check.tar.gz
else
  BUNDLE_FILE=""
fi
"$PY" - "$STEPS" "$OUT" "$MODE" "$START" "$END" "$BUDGET" "$BUNDLE_FILE" <<'EOF'
import datetime, json, os, sys

steps_path, out, mode, start, end, budget, bundle = sys.argv[1:]
steps = [json.loads(line) for line in open(steps_path) if line.strip()]
failed = [s["name"] for s in steps if s["status"] not in ("ok", "skipped")]
files = sorted(os.path.relpath(os.path.join(d, f), out)
               for d, _, fs in os.walk(out) for f in fs)
iso = lambda t: datetime.datetime.fromtimestamp(int(t), datetime.timezone.utc).isoformat()
summary = {
    "mode": mode, "ok": not failed, "failed_steps": failed,
    "started": iso(start), "finished": iso(end), "duration_s": int(end) - int(start),
    "budget_s": int(budget), "steps": steps,
    "files": [f for f in files if f != "summary.json"] + ["summary.json"],
    "bundle": bundle or None,
}
with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
width = max(len(s["name"]) for s in steps)
for s in steps:
    print(f"  {s['name']:<{width}}  {s['status']:<8} {s['duration_s']:>7.1f} s"
          + (f"  ({s['note']})" if s["note"] else ""))
print(f"gpu_check [{mode}]: " + ("all steps passed" if not failed
                                 else f"FAILED: {', '.join(failed)}") + f"; results in {out}")
EOF
SUMMARY_RC=$?

if [ "$BUNDLE" = 1 ]; then
  # Everything but summary.json goes into one archive; the originals are then removed so the
  # folder holds two files.
  if (cd "$OUT" && find . -mindepth 1 -maxdepth 1 ! -name summary.json ! -name "$BUNDLE_FILE" \
        -printf '%P\n' | tar -czf "$BUNDLE_FILE" -T -); then
    find "$OUT" -mindepth 1 -maxdepth 1 ! -name summary.json ! -name "$BUNDLE_FILE" \
      -exec rm -rf {} +
    echo "bundled into $OUT/$BUNDLE_FILE"
  else
    echo "gpu_check: bundling failed; the files stay in $OUT" >&2
    SUMMARY_RC=1
  fi
fi

[ "$SUMMARY_RC" = 0 ] || exit 1
"$PY" -c 'import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))["ok"] else 1)' \
  "$OUT/summary.json"
