#!/usr/bin/env bash
# The GPU acceptance run in stages of 295 s each (issues 18, 23 and 26; docs/VERIFYING.md
# section 7 says how to run them and read what they leave):
#
#   scripts/gpu_acceptance.sh --stage N OUTDIR        run stage N (1-4) into OUTDIR
#   scripts/gpu_acceptance.sh --dry-run [--stage N]   print every chunk's tests and minimum,
#                                                    every part with its cap; run nothing
#
# The device tool allows 600 s a command, but a 15-minute lease holds two machine starts
# and two stages, so a stage is planned for 295 s. ACCEPT_STAGE_CAP=S (60-590) runs a
# stage in S s instead: a session with less device time left sets it from the tool's
# budget_left_s less about 150 s (the machine's start and the transfers). The stage keeps
# the parts it was planned with; each part keeps its minimum while the stage has it, and
# the last parts are cut (a cut chunk names the tests it never reached).
#
# The stages are planned from the tests collected now (scripts/acceptance_plan.py): every
# tests/gpu file is in one pytest chunk, a chunk of N tests is guaranteed 15 + 0.1 N s, and
# the chunks fill the stages in order of value. Today: stage 1 = smoke and the first
# chunks; stage 2 = the host time per call (issue 25), the sync count, then the other
# chunks (lease 1); stage 3 = the tests whose timeout marker allows more than 60 s (cold
# Inductor compiles, NCCL), stage 4 = the benchmarks and the sanitizer (lease 2).
#
# Each stage installs offline (the machine may be fresh), then plans: the interpreter is
# $PYTHON if set, else the machine's python3 (a .venv in the checkout is never used unless
# PYTHON names it); `pip install -v --no-index --no-build-isolation --no-deps -e .` (-v:
# the log keeps the folders setup.py chose and the compiler's lines) with
# CONVFUSE_NO_WERROR=1 (the machine's g++ is unknown; CI keeps -Werror), csrc/ compiled
# file by file in parallel where the machine has 8 cores or more, else as one translation
# unit (CONVFUSE_UNITY_BUILD=1: a quarter to a third of the CPU time, on one core; the caller's
# CONVFUSE_UNITY_BUILD wins), and the checkout first on PYTHONPATH. A warm machine's tree
# keeps the last build: when its stamp (csrc/, setup.py, the interpreter, the build's
# environment, the binding itself) matches and the binding loads, pip is skipped. Then a
# GPU probe (at most 60 s): without a GPU the GPU parts are skipped and say so; with an
# NVIDIA GPU visible (nvidia-smi -L, /dev/nvidia0) that convfuse cannot use, the stage
# FAILs at once, with CuPy's and torch's view of it in log.txt.
#
# Results stream into OUTDIR (at most 8 files a stage, each under 16 MiB, no subfolders):
#   summary.md   rewritten before and after every part; names the part running if cut
#   log.txt      every part's command and output, flushed as it runs (2 MiB per part)
#   smoke.json   stage 1: scripts/gpu_smoke.py's table
#   tests.jsonl  one JSON line per test as it finishes (scripts/stream_results.py), and
#                one `cut` line per chunk that ended before its last test
#   junit.xml    the JUnit XML of every finished pytest chunk, merged
#   bench.jsonl  one JSON line per benchmark section as it finishes (host-overhead's in
#                stage 2, the others with the benchmarks)
#   host.json    stage 2: the host-overhead run's full JSON (fused_vs_unfused.py --from-json)
#   bench.json   the benchmarks' full JSON, in their stage
#   syncs.json   stage 2: scripts/count_syncs.py
# (compute-sanitizer, the last part, runs only if installed and time is left; its output
# goes to log.txt.) Temporary files (.summary.md.tmp, junit.xml.tmp, smoke.json.tmp) are
# renamed over their targets, one at a time, and a stale one is removed: a stage writes at
# most 7 files, and a kill leaves at most one temporary beside them.
# Exit status: 0 when every part that ran passed (skips, and chunks cut by their cap with
# no failing test, are not failures), 1 otherwise, 2 for a usage error.
set -uo pipefail

# The benchmark sections the run times (benchmarks/fused_vs_unfused.py --sections).
BENCH_SECTIONS="forward,backward,biasgrad,adam,train,compile"

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
    -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 0 ;;
    -*) echo "gpu_acceptance: unknown option $1" >&2; exit 2 ;;
    *) OUT=$1 ;;
  esac
  shift
done
case "$STAGE" in
  ""|1|2|3|4) ;;
  *) echo "gpu_acceptance: --stage takes 1 to 4, not '$STAGE'" >&2; exit 2 ;;
esac
if [ "$DRY" = 0 ] && { [ -z "$STAGE" ] || [ -z "$OUT" ]; }; then
  echo "usage: scripts/gpu_acceptance.sh --stage N OUTDIR   (or --dry-run [--stage N])" >&2
  exit 2
fi
PY=${PYTHON:-python3}

# A stage is planned for PLAN_STAGE_CAP seconds, all included (the device tool allows 600
# a command; a 15-minute lease runs two stages and two machine starts); ACCEPT_STAGE_CAP
# runs it in fewer (or more), with the same parts (see the top)
PLAN_STAGE_CAP=295
STAGE_CAP=${ACCEPT_STAGE_CAP:-$PLAN_STAGE_CAP}
if ! [[ "$STAGE_CAP" =~ ^[0-9]+$ ]] || [ "$STAGE_CAP" -lt 60 ] || [ "$STAGE_CAP" -gt 590 ]; then
  echo "gpu_acceptance: ACCEPT_STAGE_CAP takes 60 to 590 seconds, not '$STAGE_CAP'" >&2
  exit 2
fi
RESERVE=5          # kept for the last summary
PART_LOG_BYTES=$((2 * 1024 * 1024))  # six parts stay under the 16 MiB a file may bring back
MAX_BYTES=$((16 * 1024 * 1024))
TEST_TIMEOUT=${ACCEPT_TEST_TIMEOUT:-45}   # per test (pytest-timeout), where installed
SANITIZER_MIN=${ACCEPT_SANITIZER_MIN:-30} # below this the sanitizer is skipped unstarted
PART_MIN=${ACCEPT_PART_MIN:-8}            # below this no part starts
STAMP_DIR="$ROOT/.cache/acceptance"       # ignored: a warm machine keeps it
FILES="summary.md log.txt smoke.json tests.jsonl junit.xml bench.jsonl host.json bench.json syncs.json"
TEMPORARIES=".summary.md.tmp junit.xml.tmp smoke.json.tmp"
GPU_PROBE_S=60                            # the GPU probe's limit, each of its commands

# name|cap|gpu (needs a GPU)|command (run from the checkout with OUT, PY, PART_CAP set).
# cap: N (seconds), N-M (at least N, up to M when time is left) or N+ (at least N, and all
# the time left). A part gets its maximum when the later parts can still have theirs, and
# never less than its minimum while the later parts' minimums are kept.
# The install comes first (collecting tests/gpu imports the built binding); then the plan
# part collects tests/gpu (about 5 s; a warm tree reuses the last collection) and writes
# the rest of the stage's parts. The planner reads STAGE_CAP, RESERVE, BENCH_SECTIONS,
# INSTALL_PART and PLAN_PART from the environment and reserves the two parts' minimums; it
# packs every stage for PLAN_STAGE_CAP (its own constant, equal to the one here).
INSTALL_PART="install|30-240|no|offline_install"
PLAN_PART="plan|20-60|no|\"\$PY\" scripts/acceptance_plan.py --stage \"\$STAGE\" --parts \"\$SCRATCH/parts.txt\""
export STAGE_CAP RESERVE BENCH_SECTIONS INSTALL_PART PLAN_PART

stage_parts() {
  if [ -n "${ACCEPT_PARTS_FILE:-}" ]; then  # the CPU tests' stand-in parts, same format
    grep -v '^#' "$ACCEPT_PARTS_FILE"
  else
    printf '%s\n' "$INSTALL_PART" "$PLAN_PART"
  fi
}

if [ "$DRY" = 1 ]; then
  echo "gpu_acceptance: dry run; nothing is executed."
  echo "OUTDIR receives at most 8 files a stage, each under 16 MiB, from: $FILES"
  if [ -n "${ACCEPT_PARTS_FILE:-}" ]; then
    stage_parts; exit 0
  fi
  PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" scripts/acceptance_plan.py --dry-run \
    ${STAGE:+--stage "$STAGE"} || {
    echo "gpu_acceptance: the plan failed (above): $PY must collect tests/gpu with pytest," \
      "and the parts must fit the stages planned for" >&2
    exit 1
  }
  echo "(caps: N s, N-M s = at least N and up to M, N+ s = at least N and all the time left;"
  echo " sanitizer runs only if compute-sanitizer is on PATH and is skipped when out of time;"
  echo " per-test timeout ${TEST_TIMEOUT} s where pytest-timeout is installed, the selfcheck's"
  echo " chunk excepted)"
  exit 0
fi

mkdir -p "$OUT" || { echo "gpu_acceptance: cannot create $OUT" >&2; exit 2; }
OUT=$(cd "$OUT" && pwd)
SCRATCH=$(mktemp -d)
STATUS="$SCRATCH/status"
LOG="$OUT/log.txt"
: >"$STATUS"
: >"$LOG"
for t in $TEMPORARIES; do rm -f "$OUT/$t"; done  # a stale one from an earlier run
export OUT SCRATCH PY STAGE STAMP_DIR
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 CONVFUSE_NO_WERROR=1
# csrc/ file by file (setup.py compiles them in parallel, one job a core) where the cores
# are many: the longest file takes about half the one translation unit's time; else as one
CORES=$(nproc 2>/dev/null || echo 1)
if [ -z "${CONVFUSE_UNITY_BUILD:-}" ]; then
  if [ "$CORES" -ge 8 ]; then CONVFUSE_UNITY_BUILD=0; else CONVFUSE_UNITY_BUILD=1; fi
fi
export CONVFUSE_UNITY_BUILD
export PYTHONPATH="$ROOT:$ROOT/scripts${PYTHONPATH:+:$PYTHONPATH}"
# CuPy's kernel cache lives in the tree (ignored), so a warm machine's later stage finds
# the kernels the earlier one compiled
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-$ROOT/.cache/cupy}
START=$(date +%s)
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
  rm -f "$OUT/.summary.md.tmp"  # left only by a summary that failed before its rename
}

capped() {  # pass lines on as they come (head -c buffers) up to 3/4 of the cap, then keep
  # only the last quarter's worth, printed at the end: pytest's summary is at the end
  local n=0 line kept=0 start=0 next=0 dropped=0
  local head=$((PART_LOG_BYTES * 3 / 4)) keep=$((PART_LOG_BYTES / 4))
  local -a tail=()
  while IFS= read -r line || [ -n "$line" ]; do
    n=$((n + ${#line} + 1))
    if [ "$n" -le "$head" ]; then printf '%s\n' "$line"; continue; fi
    tail[next]=$line; next=$((next + 1)); kept=$((kept + ${#line} + 1))
    while [ "$kept" -gt "$keep" ] && [ $((next - start)) -gt 1 ]; do
      kept=$((kept - ${#tail[start]} - 1)); unset "tail[$start]"
      start=$((start + 1)); dropped=$((dropped + 1))
    done
  done
  [ "$dropped" -gt 0 ] && echo "($dropped lines dropped after the first $head bytes; the last lines follow)"
  [ "$next" -gt "$start" ] && printf '%s\n' "${tail[@]}"
  return 0
}

build_stamp() {  # everything the built binding depends on, hashed
  {
    find csrc -type f -print0 | sort -z | xargs -0 sha256sum
    sha256sum setup.py pyproject.toml
    "$PY" -c 'import sys, sysconfig; print(sys.executable, sys.version, sysconfig.get_config_var("EXT_SUFFIX"))'
    env | grep -E '^(CONVFUSE_[A-Z_]+|CUDA_HOME|CUDA_PATH|CC|CXX|CFLAGS|CXXFLAGS|CPPFLAGS|LDFLAGS|NPY_NUM_BUILD_JOBS)=' | sort
    sha256sum convfuse/_cudnn*.so 2>&1
  } | sha256sum | cut -d' ' -f1
}

offline_install() {
  echo "python: $(command -v "$PY") ($("$PY" -V 2>&1))"
  local check='import convfuse, convfuse._binding as b; print("convfuse", convfuse.__file__); print("cuDNN", b.cudnn().getVersion())'
  if [ -f "$STAMP_DIR/install.stamp" ] && [ "$(cat "$STAMP_DIR/install.stamp")" = "$(build_stamp)" ]; then
    if "$PY" -c "$check"; then
      echo "build reused: csrc/, setup.py, the interpreter and the build flags match the stamp"
      return 0
    fi
    echo "the stamp matches but the binding does not load: building again"
  fi
  rm -f "$STAMP_DIR/install.stamp"
  echo "build: CONVFUSE_UNITY_BUILD=$CONVFUSE_UNITY_BUILD on $CORES cores"
  # -v: setup.py's own lines (the cuDNN and CUDA folders it chose) and the compiler's
  "$PY" -m pip install -v --no-index --no-build-isolation --no-deps -e . || return 1
  "$PY" -c "$check" || return 1
  mkdir -p "$STAMP_DIR" && build_stamp >"$STAMP_DIR/install.stamp"
}

merge_junit() {  # merge_junit CHUNK FILE: add one chunk's <testsuite> to OUT/junit.xml
  "$PY" - "$1" "$2" "$OUT/junit.xml" <<'EOF2'
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
EOF2
}

chunk() {  # chunk NAME EXPECTED FILES...: one pytest chunk, streamed per test, then its JUnit
  local name=$1; shift 2
  local timeout_opts=() per_test=${CHUNK_TEST_TIMEOUT:-$TEST_TIMEOUT}
  if "$PY" -c 'import pytest_timeout' 2>/dev/null; then
    # thread method: a test hung inside C (an NCCL init, a wedged cuDNN call) never lets a
    # SIGALRM handler run; the thread dumps every stack into log.txt and ends the chunk,
    # tests.jsonl names the test, and the next chunk starts
    timeout_opts=(--timeout "$per_test" --timeout-method thread)
    if [ "$per_test" = 0 ]; then echo "(no per-test timeout: the chunk's cap governs)"
    else echo "(per-test timeout $per_test s)"; fi
  else
    echo "(pytest-timeout not installed: no per-test timeout, only the chunk's cap)"
  fi
  # --continue-on-collection-errors: a file that fails to import costs its own tests, not
  # the chunk's hundreds (pytest otherwise stops the session at a collection error)
  "$PY" -m pytest -q -p no:cacheprovider -p fusion_strict -p stream_results \
    --continue-on-collection-errors \
    --stream-results "$OUT/tests.jsonl" --chunk "$name" "${timeout_opts[@]}" \
    --junitxml "$SCRATCH/$name.xml" -o junit_family=xunit2 --durations=10 "$@"
  local rc=$?
  [ -s "$SCRATCH/$name.xml" ] && merge_junit "$name" "$SCRATCH/$name.xml"
  rm -f "$OUT/junit.xml.tmp"  # left only by a merge that failed before its rename
  return $rc
}

sanitizer() {
  # memory errors only: a CUDA API call that fails and is handled (a library probing a
  # feature, the sync counter's capture probe) is no finding of memcheck's
  compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
    --print-limit 100 \
    "$PY" scripts/count_syncs.py --worker --steps 1
}
export -f offline_install build_stamp merge_junit chunk sanitizer
export TEST_TIMEOUT CORES

gpu_visible() {  # the NVIDIA GPU the machine shows, whatever CuPy makes of it
  local listed
  if command -v nvidia-smi >/dev/null \
      && listed=$(timeout -k 5 20 nvidia-smi -L 2>/dev/null) && [ -n "$listed" ]; then
    printf '%s\n' "$listed" | head -n 1
    return 0
  fi
  [ -e /dev/nvidia0 ] && { echo "/dev/nvidia0 exists"; return 0; }
  return 1
}

gpu_probe() {  # after the install: sets GPU_REASON (empty: a usable GPU) and gpu_broken
  local t0 out rc line visible
  t0=$(date +%s)
  # the marked line alone: a warning on stderr, or a crash at exit after the answer, must
  # not read as the reason; a probe that hangs (a wedged driver) is ended
  out=$(timeout -k 5 "$GPU_PROBE_S" "$PY" -c 'from convfuse.backend import gpu_unavailable_reason as r; print("REASON:" + (r() or ""))' 2>>"$LOG")
  rc=$?
  line=$(printf '%s\n' "$out" | grep '^REASON:' | tail -n 1)
  if [ -n "$line" ]; then
    GPU_REASON=${line#REASON:}
  elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    GPU_REASON="the GPU probe (convfuse.backend.gpu_unavailable_reason) gave no answer in $GPU_PROBE_S s"
  else
    GPU_REASON="convfuse.backend did not import (exit $rc; see log.txt)"
  fi
  echo "== GPU probe: ${GPU_REASON:-a usable GPU}" >>"$LOG"
  # the card and driver in every stage's log (stage 3 writes no smoke.json or benchmark)
  if command -v nvidia-smi >/dev/null; then
    timeout -k 5 10 nvidia-smi --query-gpu=name,driver_version,memory.total \
      --format=csv,noheader >>"$LOG" 2>&1 || true
  fi
  # no usable GPU on a machine that shows one: CuPy or the driver is broken there, and a
  # stage of skipped parts would read as a green run that spent the lease
  if [ -n "$GPU_REASON" ] && visible=$(gpu_visible); then
    gpu_broken=1
    echo "gpu-probe 1 $(( $(date +%s) - t0 )) the machine shows an NVIDIA GPU ($visible) but convfuse cannot use it: $GPU_REASON. CuPy's and torch's view of it are in log.txt; the stage ended here" >>"$STATUS"
    echo "gpu_acceptance: gpu-probe FAIL: the machine shows an NVIDIA GPU ($visible) but convfuse cannot use it: $GPU_REASON"
  fi
}

gpu_diagnose() {  # what helps to see why the visible GPU is unusable, into log.txt
  local left each
  left=$((STAGE_CAP - RESERVE - ($(date +%s) - START)))
  each=$((left / 3)); [ "$each" -gt 30 ] && each=30; [ "$each" -lt 5 ] && each=5
  {
    echo "== gpu-probe diagnosis (each command at most $each s): the reason: $GPU_REASON"
    if command -v nvidia-smi >/dev/null; then
      echo "-- nvidia-smi"; timeout -k 5 "$each" nvidia-smi 2>&1 | head -n 40
    fi
    ls -l /dev/nvidia* 2>&1 | head -n 20
    echo "-- cupy.show_config()"
    timeout -k 5 "$each" "$PY" -c 'import cupy; cupy.show_config()' 2>&1 | tail -n 60
    echo "-- torch"
    timeout -k 5 "$each" "$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda); print("torch.cuda.is_available()", torch.cuda.is_available(), "device_count", torch.cuda.device_count())' 2>&1 | tail -n 20
  } >>"$LOG" 2>&1
}

mapfile -t PARTS < <(stage_parts "$STAGE")
PLAN=$(printf '%s\n' "${PARTS[@]}" | cut -d'|' -f1 | tr '\n' ' ')
summary
install_ok=1
gpu_broken=0
i=0
while [ "$i" -lt "${#PARTS[@]}" ]; do
  IFS='|' read -r name cap gpu cmd <<<"${PARTS[$i]}"
  t0=$(date +%s)
  lo=${cap%%[-+]*}
  case "$cap" in *-*) hi=${cap#*-} ;; *+) hi=100000 ;; *) hi=$lo ;; esac
  later_lo=0; later_hi=0
  for j in "${!PARTS[@]}"; do
    [ "$j" -le "$i" ] && continue
    IFS='|' read -r _ c g _ <<<"${PARTS[$j]}"; l=${c%%[-+]*}
    [ "$g" = yes ] && [ -n "$GPU_REASON" ] && continue  # skipped: it needs no time
    case "$c" in *-*) h=${c#*-} ;; *) h=$l ;; esac
    later_lo=$((later_lo + l)); later_hi=$((later_hi + h))
  done
  left=$((STAGE_CAP - RESERVE - (t0 - START)))
  cap=$((left - later_hi))
  [ "$cap" -lt "$lo" ] && cap=$lo
  [ "$cap" -gt "$hi" ] && cap=$hi
  if [ "$cap" -gt $((left - later_lo)) ]; then
    cap=$((left - later_lo))
    # the later parts' minimums no longer fit (a cap shrunk by ACCEPT_STAGE_CAP, or parts
    # that overran): this part keeps its own minimum while the stage has it, and the last
    # parts are cut instead (the plan is in order of value)
    if [ "$cap" -lt "$lo" ]; then cap=$(( lo < left ? lo : left )); fi
  fi
  note=""
  if [ "$install_ok" = 0 ]; then
    rc=126; note="the install failed"
  elif [ "$gpu" = yes ] && [ -n "$GPU_REASON" ]; then
    rc=125; note="$GPU_REASON"
  elif [ "$name" = sanitizer ] && ! command -v compute-sanitizer >/dev/null; then
    rc=127; note="compute-sanitizer not on PATH"
  elif [ "$name" = sanitizer ] && [ "$cap" -lt "$SANITIZER_MIN" ]; then
    rc=122; note="only $cap s left in the stage's ${STAGE_CAP} s; it needs $SANITIZER_MIN"
  elif [ "$cap" -lt "$PART_MIN" ]; then
    rc=124; note="only $cap s left in the stage's ${STAGE_CAP} s"
  else
    summary "$name" "$t0"
    echo "== $name (cap $cap s, started $(date -u +%H:%M:%S) UTC): $cmd" >>"$LOG"
    PART_CAP=$cap timeout -s INT --kill-after=10 "$cap" bash -c "$cmd" 2>&1 | capped >>"$LOG"
    rc=${PIPESTATUS[0]}
    [ "$rc" = 137 ] && rc=124
    [ "$rc" = 124 ] && note="cut by its $cap s cap"
  fi
  # the sanitizer's time is whatever the stage has left: running out of it is not a finding
  [ "$name" = sanitizer ] && [ "$rc" = 124 ] && rc=122
  # KINDS.md: on a gVisor machine compute-sanitizer refuses the device ("Device not
  # supported", then error 999): the tool is missing there, which is not a finding
  if [ "$name" = sanitizer ] && [ "$rc" != 0 ] && [ "$rc" != 127 ] \
      && sed -n "/^== sanitizer (cap/,\$p" "$LOG" | grep -q "Device not supported"; then
    rc=127; note="compute-sanitizer does not support this device here (KINDS.md: gVisor)"
  fi
  if [[ " $cmd " =~ \ chunk\ $name\ ([0-9]+)\  ]]; then
    expected=${BASH_REMATCH[1]}
    if [ "$rc" != 0 ] && [ "$rc" != 125 ] && [ "$rc" != 126 ]; then
      # name the test it reached and how many it never reached (tests.jsonl and the note)
      why=${note:-exit $rc (a per-test timeout, a crash or a failure)}
      cut_note=$("$PY" scripts/acceptance_summary.py "$OUT" "$STATUS" --cut "$name" \
        --expected "$expected" --why "$why" 2>>"$LOG") && [ -n "$cut_note" ] && note=$cut_note
    fi
  fi
  spent=$(( $(date +%s) - t0 ))
  echo "$name $rc $spent $note" >>"$STATUS"
  echo "== $name: exit $rc after $spent s${note:+ ($note)}" >>"$LOG"
  echo "gpu_acceptance: $name exit $rc after $spent s${note:+ ($note)}"
  if [ "$name" = plan ] && [ -s "$SCRATCH/parts.txt" ]; then
    mapfile -t -O "${#PARTS[@]}" PARTS <"$SCRATCH/parts.txt"
    PLAN=$(printf '%s\n' "${PARTS[@]}" | cut -d'|' -f1 | tr '\n' ' ')
  fi
  if [ "$name" = install ]; then
    if [ "$rc" != 0 ]; then
      install_ok=0
    else
      gpu_probe
    fi
  fi
  summary
  if [ "$gpu_broken" = 1 ]; then  # the stage ends here: nothing after it can be a result
    gpu_diagnose
    for j in "${!PARTS[@]}"; do
      [ "$j" -le "$i" ] && continue
      echo "${PARTS[$j]%%|*} 123 0 the GPU probe failed: the stage ended before this part" >>"$STATUS"
    done
    summary
    break
  fi
  i=$((i + 1))
done

for f in "$OUT"/*; do  # the 16 MiB cap (nothing above should come near it)
  if [ -f "$f" ] && [ "$(stat -c %s "$f")" -ge "$MAX_BYTES" ]; then
    truncate -s $((MAX_BYTES - 1)) "$f"
  fi
done
cat "$OUT/summary.md"
# the summary's own rule (a chunk cut with no failing test is not a failure); awk if
# python is broken
failed=$("$PY" scripts/acceptance_summary.py "$OUT" "$STATUS" --failed 2>>"$LOG") ||
  failed=$(awk '$2 != 0 && $2 != 122 && $2 != 123 && $2 != 125 && $2 != 127 {print $1}' "$STATUS" 2>/dev/null)
rm -rf "$SCRATCH"
[ -z "$failed" ]
