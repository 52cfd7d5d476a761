#!/usr/bin/env bash
# The GPU acceptance run in stages of at most 300 s each (issues 18 and 23; docs/VERIFYING.md
# section 7 says how to read what it leaves):
#
#   scripts/gpu_acceptance.sh --stage N OUTDIR        run stage N (1-4) into OUTDIR
#   scripts/gpu_acceptance.sh --dry-run [--stage N]   print every chunk's tests and minimum,
#                                                    every part with its cap; run nothing
#
# The stages are planned from the tests collected now (scripts/acceptance_plan.py): every
# tests/gpu file is in one pytest chunk, a chunk of N tests is guaranteed 15 + 0.1 N s, and
# the chunks fill the stages in order of value, then the sync count, the host-overhead
# benchmark, the other benchmarks and the sanitizer. A 15-minute lease runs two stages
# (today: 1 = smoke and most tests, 2 = the other tests, the sync count and the host time
# per call); stage 3 (the benchmarks, the sanitizer) takes a second.
#
# Each stage installs offline (the machine may be fresh), then plans: the interpreter is
# $PYTHON if set, else the machine's python3 (a .venv in the checkout is never used unless
# PYTHON names it); `pip install --no-index --no-build-isolation --no-deps -e .` with
# CONVFUSE_NO_WERROR=1 (the machine's g++ is unknown; CI keeps -Werror) and
# CONVFUSE_UNITY_BUILD=1 (csrc/ as one translation unit: a quarter of the CPU time), and
# the checkout first on PYTHONPATH. A warm machine's tree keeps the last build: when its
# stamp (csrc/, setup.py, the interpreter, the build's environment, the binding itself)
# matches and the binding loads, pip is skipped. Without a usable GPU the GPU parts are
# skipped and say so.
#
# Results stream into OUTDIR (at most 8 files, each under 16 MiB, no subfolders):
#   summary.md   rewritten before and after every part; names the part running if cut
#   log.txt      every part's command and output, flushed as it runs (2 MiB per part)
#   smoke.json   stage 1: scripts/gpu_smoke.py's table
#   tests.jsonl  one JSON line per test as it finishes (scripts/stream_results.py), and
#                one `cut` line per chunk that ended before its last test
#   junit.xml    the JUnit XML of every finished pytest chunk, merged
#   bench.jsonl  one JSON line per benchmark section as it finishes (host-overhead's in
#                stage 2, the others in stage 3)
#   syncs.json   scripts/count_syncs.py
# (compute-sanitizer, the last part, runs only if installed and time is left; its output
# goes to log.txt.) Temporary files (.summary.md.tmp, junit.xml.tmp) are renamed over
# their targets, so a kill leaves complete files: at most 8 files even then.
# Exit status: 0 when every part that ran passed (skips, and chunks cut by their cap with
# no failing test, are not failures), 1 otherwise, 2 for a usage error.
set -uo pipefail

# The benchmark sections the run times (benchmarks/fused_vs_unfused.py --sections).
BENCH_SECTIONS="forward,biasgrad,adam,train,compile"

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
    -h|--help) sed -n '2,38p' "$0"; exit 0 ;;
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

STAGE_CAP=295      # seconds per stage, all included; the visit allows 300 per command
RESERVE=5          # kept for the last summary
PART_LOG_BYTES=$((2 * 1024 * 1024))  # six parts stay under the 16 MiB a file may bring back
MAX_BYTES=$((16 * 1024 * 1024))
TEST_TIMEOUT=${ACCEPT_TEST_TIMEOUT:-45}   # per test (pytest-timeout), where installed
SANITIZER_MIN=${ACCEPT_SANITIZER_MIN:-30} # below this the sanitizer is skipped unstarted
PART_MIN=${ACCEPT_PART_MIN:-8}            # below this no part starts
STAMP_DIR="$ROOT/.cache/acceptance"       # ignored: a warm machine keeps it
FILES="summary.md log.txt smoke.json tests.jsonl junit.xml bench.jsonl syncs.json"

# name|cap|gpu (needs a GPU)|command (run from the checkout with OUT, PY, PART_CAP set).
# cap: N (seconds), N-M (at least N, up to M when time is left) or N+ (at least N, and all
# the time left). A part gets its maximum when the later parts can still have theirs, and
# never less than its minimum while the later parts' minimums are kept.
# The install comes first (collecting tests/gpu imports the built binding); then the plan
# part collects tests/gpu (about 5 s; a warm tree reuses the last collection) and writes
# the rest of the stage's parts. The planner reads STAGE_CAP, RESERVE, BENCH_SECTIONS,
# INSTALL_PART and PLAN_PART from the environment and reserves the two parts' minimums.
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
  echo "OUTDIR receives at most 8 files, each under 16 MiB: $FILES"
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
export OUT SCRATCH PY STAGE STAMP_DIR
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 CONVFUSE_NO_WERROR=1 CONVFUSE_UNITY_BUILD=1
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
  "$PY" -m pip install --no-index --no-build-isolation --no-deps -e . || return 1
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
export TEST_TIMEOUT

mapfile -t PARTS < <(stage_parts "$STAGE")
PLAN=$(printf '%s\n' "${PARTS[@]}" | cut -d'|' -f1 | tr '\n' ' ')
summary
install_ok=1
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
  [ "$cap" -gt $((left - later_lo)) ] && cap=$((left - later_lo))
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
      # the marked line alone: a warning on stderr, or a crash at exit after the answer,
      # must not read as the reason
      GPU_LINE=$("$PY" -c 'from convfuse.backend import gpu_unavailable_reason as r; print("REASON:" + (r() or ""))' 2>>"$LOG" | grep '^REASON:' | tail -n 1)
      if [ -n "$GPU_LINE" ]; then
        GPU_REASON=${GPU_LINE#REASON:}
      else
        GPU_REASON="convfuse.backend did not import (see log.txt)"
      fi
    fi
  fi
  summary
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
  failed=$(awk '$2 != 0 && $2 != 122 && $2 != 125 && $2 != 127 {print $1}' "$STATUS" 2>/dev/null)
rm -rf "$SCRATCH"
[ -z "$failed" ]
