#!/usr/bin/env bash
# The GPU acceptance run in two stages of at most 300 s each (issue 18; docs/VERIFYING.md
# section 7 says how to read what it leaves):
#
#   scripts/gpu_acceptance.sh --stage 1 OUTDIR   does the core work? install, smoke, core tests
#   scripts/gpu_acceptance.sh --stage 2 OUTDIR   the other GPU tests, headline numbers, syncs
#   scripts/gpu_acceptance.sh --dry-run [--stage N]  print every part with its cap; run nothing
#
# Each stage starts with an offline install (the machine may be fresh): the interpreter is
# $PYTHON if set, else the machine's python3 (a .venv in the checkout is never used unless
# PYTHON names it); `pip install --no-index --no-build-isolation --no-deps -e .` with
# CONVFUSE_NO_WERROR=1 (the machine's g++ is unknown; CI keeps -Werror) and
# CONVFUSE_UNITY_BUILD=1 (csrc/ as one translation unit: a quarter of the CPU time), and
# the checkout first on PYTHONPATH. Without a usable GPU the GPU parts are skipped and say so.
#
# Results stream into OUTDIR (at most 8 files, each under 16 MiB, no subfolders):
#   summary.md   rewritten before and after every part; names the part running if cut
#   log.txt      every part's command and output, flushed as it runs (3 MiB per part)
#   smoke.json   stage 1: scripts/gpu_smoke.py's table
#   tests.jsonl  one JSON line per test as it finishes (scripts/stream_results.py)
#   junit.xml    the JUnit XML of every finished pytest chunk, merged
#   bench.jsonl  stage 2: one JSON line per benchmark section as it finishes
#   syncs.json   stage 2: scripts/count_syncs.py
# (compute-sanitizer, stage 2's last part, runs only if installed and time is left; its
# output goes to log.txt.) Temporary files (.summary.md.tmp, junit.xml.tmp) are renamed
# over their targets, so a kill leaves complete files: at most 8 files even then.
# Exit status: 0 when every part that ran passed (skips are not failures), 1 otherwise,
# 2 for a usage error.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
DRY=0
STAGE=""
OUT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --stage) shift; STAGE=${1:-} ;;
    --stage=*) STAGE=${1#--stage=} ;;
    -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
    -*) echo "gpu_acceptance: unknown option $1" >&2; exit 2 ;;
    *) OUT=$1 ;;
  esac
  shift
done
if [ -n "$STAGE" ] && [ "$STAGE" != 1 ] && [ "$STAGE" != 2 ]; then
  echo "gpu_acceptance: --stage takes 1 or 2, not '$STAGE'" >&2; exit 2
fi
if [ "$DRY" = 0 ] && { [ -z "$STAGE" ] || [ -z "$OUT" ]; }; then
  echo "usage: scripts/gpu_acceptance.sh --stage 1|2 OUTDIR   (or --dry-run [--stage N])" >&2
  exit 2
fi
PY=${PYTHON:-python3}

STAGE_CAP=295      # seconds per stage, all included; the visit allows 300 per command
RESERVE=5          # kept for the last summary
PART_LOG_BYTES=$((3 * 1024 * 1024))
MAX_BYTES=$((16 * 1024 * 1024))
TEST_TIMEOUT=${ACCEPT_TEST_TIMEOUT:-45}   # per test (pytest-timeout), where installed

# Chunks of tests/gpu, most valuable first (the fused paths, layers, training step,
# torch bridge; then the op grid; then the BatchNorm and kernel grids; then the rest).
CHUNK_core="tests/gpu/test_binding_gpu_handle.py tests/gpu/test_fused_path_gpu.py tests/gpu/test_layers_gpu.py tests/gpu/test_graph_gpu.py tests/gpu/test_optim_gpu.py tests/gpu/test_torch_gpu.py tests/gpu/test_torch_batchnorm_gpu.py tests/gpu/test_models_gpu.py tests/gpu/test_loss_gpu.py"
CHUNK_ops="tests/gpu/test_cudnn_ops.py"
CHUNK_bn="tests/gpu/test_batchnorm_gpu.py tests/gpu/test_elementwise_gpu.py tests/gpu/test_edge_values_gpu.py tests/gpu/test_robust_gpu.py"
# The last chunk also takes every tests/gpu file no chunk names (a file added later runs
# without an edit here), with the whole selfcheck last. Its command-line test reruns the
# whole selfcheck in a subprocess: the CPU suite covers the command line, so it stays out.
CHUNK_rest="tests/gpu/test_fused_fallback_gpu.py tests/gpu/test_binding_gpu_conv.py tests/gpu/test_binding_gpu_conv_fused.py tests/gpu/test_binding_gpu_conv_layouts.py tests/gpu/test_binding_gpu_activation_pooling.py"
for f in tests/gpu/test_*.py; do
  case " $CHUNK_core $CHUNK_ops $CHUNK_bn $CHUNK_rest tests/gpu/test_selfcheck_gpu.py " in
    *" $f "*) ;;
    *) CHUNK_rest="$CHUNK_rest $f" ;;
  esac
done
CHUNK_rest="$CHUNK_rest tests/gpu/test_selfcheck_gpu.py --deselect tests/gpu/test_selfcheck_gpu.py::test_command_line_exits_zero_and_writes_json"

# name|cap|gpu (needs a GPU)|command (run from the checkout with OUT, PY set).
# cap: N (seconds), N-M (at least N, up to M when time is left) or N+ (at least N, and all
# the time left). A part gets its maximum when the later parts can still have theirs, and
# never less than its minimum while the later parts' minimums are kept. The install's cap
# allows a busy 2-core machine (the unity build: about 25 CPU-s; 8 files: 95 CPU-s, 150-250 s
# wall seen with 7 jobs on 2 cores); on
# the GPU machine's 16 cores it takes far less, and what it leaves goes to the later parts.
STAGE1=(
  "install|240|no|offline_install"
  "smoke|40-90|no|\"\$PY\" scripts/gpu_smoke.py --json \"\$OUT/smoke.json\""
  "gpu-core|5+|yes|chunk gpu-core $CHUNK_core"
  "gpu-ops|5+|yes|chunk gpu-ops $CHUNK_ops"
)
STAGE2=(
  "install|240|no|offline_install"
  "gpu-bn|5+|yes|chunk gpu-bn $CHUNK_bn"
  "gpu-rest|5+|yes|chunk gpu-rest $CHUNK_rest"
  "bench|20-110|yes|\"\$PY\" benchmarks/fused_vs_unfused.py --quick --quiet --sections forward,biasgrad,adam,train --resnet --stream \"\$OUT/bench.jsonl\" --out \"\$SCRATCH/bench.json\" --plot \"\$SCRATCH/bench.png\""
  "syncs|10-25|yes|\"\$PY\" scripts/count_syncs.py --steps 5 --out \"\$OUT/syncs.json\""
  "sanitizer|0+|yes|sanitizer"
)
FILES="summary.md log.txt smoke.json tests.jsonl junit.xml bench.jsonl syncs.json"

stage_parts() {
  if [ -n "${ACCEPT_PARTS_FILE:-}" ]; then  # the CPU tests' stand-in parts, same format
    grep -v '^#' "$ACCEPT_PARTS_FILE"
  elif [ "$1" = 1 ]; then printf '%s\n' "${STAGE1[@]}"; else printf '%s\n' "${STAGE2[@]}"; fi
}

if [ "$DRY" = 1 ]; then
  echo "gpu_acceptance: dry run; nothing is executed."
  echo "OUTDIR receives at most 8 files, each under 16 MiB: $FILES"
  for s in ${STAGE:-1 2}; do
    echo "stage $s parts (name, cap, needs a GPU, command):"
    while IFS='|' read -r name cap gpu cmd; do
      printf '  %-10s %6s s  gpu=%-3s  %s\n' "$name" "$cap" "$gpu" "$cmd"
    done < <(stage_parts "$s")
  done
  echo "(caps: N s, N-M s = at least N and up to M, N+ s = at least N and all the time left;"
  echo " sanitizer runs only if compute-sanitizer is on PATH; per-test timeout ${TEST_TIMEOUT} s where pytest-timeout is installed)"
  for s in ${STAGE:-1 2}; do echo "stage $s: cap $STAGE_CAP s"; done
  exit 0
fi

mkdir -p "$OUT" || { echo "gpu_acceptance: cannot create $OUT" >&2; exit 2; }
OUT=$(cd "$OUT" && pwd)
SCRATCH=$(mktemp -d)
STATUS="$SCRATCH/status"
LOG="$OUT/log.txt"
: >"$STATUS"
: >"$LOG"
export OUT SCRATCH PY
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 CONVFUSE_NO_WERROR=1 CONVFUSE_UNITY_BUILD=1
export PYTHONPATH="$ROOT:$ROOT/scripts${PYTHONPATH:+:$PYTHONPATH}"
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-$SCRATCH/cupy-cache}
START=$(date +%s)
PLAN=$(stage_parts "$STAGE" | cut -d'|' -f1 | tr '\n' ' ')
GPU_REASON=""

summary() {  # summary [running-part since]; never fails the run
  local args=("$OUT" "$STATUS" --stage "$STAGE" --plan "$PLAN" --started "$START" --quiet)
  [ -n "${1:-}" ] && args+=(--running "$1" --since "$2")
  [ -n "$GPU_REASON" ] && args+=(--gpu-reason "$GPU_REASON")
  "$PY" scripts/acceptance_summary.py "${args[@]}" 2>>"$LOG" || {
    # python itself is broken: a plain summary, so the visit still returns an answer
    { echo "# convfuse GPU acceptance run, stage $STAGE"; echo
      echo "acceptance_summary.py failed (see log.txt); parts so far (name exit seconds):"
      sed 's/^/    /' "$STATUS"; [ -n "${1:-}" ] && echo "running: $1 since $2"; } >"$OUT/summary.md"
  }
}

capped() {  # pass lines on as they come (head -c buffers), and drop those past the cap
  local n=0 line
  while IFS= read -r line || [ -n "$line" ]; do
    n=$((n + ${#line} + 1))
    [ "$n" -le "$PART_LOG_BYTES" ] && printf '%s\n' "$line"
  done
  [ "$n" -gt "$PART_LOG_BYTES" ] && echo "(output past $PART_LOG_BYTES bytes dropped)"
  return 0
}

offline_install() {
  echo "python: $(command -v "$PY") ($("$PY" -V 2>&1))"
  "$PY" -m pip install --no-index --no-build-isolation --no-deps -e . || return 1
  "$PY" -c 'import convfuse, convfuse._binding as b; print("convfuse", convfuse.__file__); print("cuDNN", b.cudnn().getVersion())'
}

merge_junit() {  # merge_junit CHUNK FILE: add one chunk's <testsuite> to OUT/junit.xml
  "$PY" - "$1" "$2" "$OUT/junit.xml" <<'EOF'
import os, sys, xml.etree.ElementTree as ET
chunk, part, merged = sys.argv[1:]
try:
    root = ET.parse(merged).getroot()
except (OSError, ET.ParseError):
    root = ET.Element("testsuites")
src = ET.parse(part).getroot()
for suite in (src.iter("testsuite") if src.tag == "testsuites" else [src]):
    suite.set("name", chunk)
    root.append(suite)
ET.ElementTree(root).write(merged + ".tmp", encoding="utf-8", xml_declaration=True)
os.replace(merged + ".tmp", merged)
EOF
}

chunk() {  # chunk NAME FILES...: one pytest chunk, streamed per test, then its JUnit
  local name=$1; shift
  local timeout_opts=()
  if "$PY" -c 'import pytest_timeout' 2>/dev/null; then
    # thread method: a test hung inside C (an NCCL init, a wedged cuDNN call) never lets a
    # SIGALRM handler run; the thread dumps every stack into log.txt and ends the chunk,
    # tests.jsonl names the test, and the next chunk starts
    timeout_opts=(--timeout "$TEST_TIMEOUT" --timeout-method thread)
  else
    echo "(pytest-timeout not installed: no per-test timeout, only the chunk's cap)"
  fi
  "$PY" -m pytest -q -p no:cacheprovider -p fusion_strict -p stream_results \
    --stream-results "$OUT/tests.jsonl" --chunk "$name" "${timeout_opts[@]}" \
    --junitxml "$SCRATCH/$name.xml" -o junit_family=xunit2 --durations=10 "$@"
  local rc=$?
  [ -s "$SCRATCH/$name.xml" ] && merge_junit "$name" "$SCRATCH/$name.xml"
  return $rc
}

sanitizer() {
  compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 100 \
    "$PY" scripts/count_syncs.py --worker --steps 1
}
export -f offline_install merge_junit chunk sanitizer
export TEST_TIMEOUT

summary
mapfile -t PARTS < <(stage_parts "$STAGE")
install_ok=1
for i in "${!PARTS[@]}"; do
  IFS='|' read -r name cap gpu cmd <<<"${PARTS[$i]}"
  t0=$(date +%s)
  lo=${cap%%[-+]*}
  case "$cap" in *-*) hi=${cap#*-} ;; *+) hi=100000 ;; *) hi=$lo ;; esac
  later_lo=0; later_hi=0
  for j in "${!PARTS[@]}"; do
    [ "$j" -le "$i" ] && continue
    c=$(cut -d'|' -f2 <<<"${PARTS[$j]}"); l=${c%%[-+]*}
    case "$c" in *-*) h=${c#*-} ;; *) h=$l ;; esac
    later_lo=$((later_lo + l)); later_hi=$((later_hi + h))
  done
  left=$((STAGE_CAP - RESERVE - (t0 - START)))
  cap=$((left - later_hi))
  [ "$cap" -lt "$lo" ] && cap=$lo
  [ "$cap" -gt "$hi" ] && cap=$hi
  [ "$cap" -gt $((left - later_lo)) ] && cap=$((left - later_lo))
  note=""
  if [ "$install_ok" = 0 ]; then
    rc=126; note="the install failed"
  elif [ "$gpu" = yes ] && [ -n "$GPU_REASON" ]; then
    rc=125; note="$GPU_REASON"
  elif [ "$name" = sanitizer ] && ! command -v compute-sanitizer >/dev/null; then
    rc=127; note="compute-sanitizer not on PATH"
  elif [ "$cap" -lt 8 ]; then
    rc=124; note="no time left in the stage's ${STAGE_CAP} s"
  else
    summary "$name" "$t0"
    echo "== $name (cap $cap s, started $(date -u +%H:%M:%S) UTC): $cmd" >>"$LOG"
    timeout -s INT --kill-after=10 "$cap" bash -c "$cmd" 2>&1 | capped >>"$LOG"
    rc=${PIPESTATUS[0]}
    [ "$rc" = 137 ] && rc=124
  fi
  spent=$(( $(date +%s) - t0 ))
  echo "$name $rc $spent $note" >>"$STATUS"
  echo "== $name: exit $rc after $spent s${note:+ ($note)}" >>"$LOG"
  echo "gpu_acceptance: $name exit $rc after $spent s${note:+ ($note)}"
  if [ "$name" = install ]; then
    if [ "$rc" != 0 ]; then
      install_ok=0
    else
      GPU_REASON=$("$PY" -c 'from convfuse.backend import gpu_unavailable_reason as r; print(r() or "")' 2>&1 | tail -n 1)
    fi
  fi
  summary
done

for f in "$OUT"/*; do  # the 16 MiB cap (nothing above should come near it)
  if [ -f "$f" ] && [ "$(stat -c %s "$f")" -ge "$MAX_BYTES" ]; then
    truncate -s $((MAX_BYTES - 1)) "$f"
  fi
done
cat "$OUT/summary.md"
failed=$(awk '$2 != 0 && $2 != 125 && $2 != 127' "$STATUS" 2>/dev/null | wc -l)
rm -rf "$SCRATCH"
[ "$failed" -eq 0 ]
