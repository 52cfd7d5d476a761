#!/usr/bin/env bash
# The first GPU hour in one command (issue #13); docs/VERIFYING.md section 7 reads its output.
#
#   scripts/gpu_acceptance.sh OUTDIR            run everything (budgeted for 20 minutes on one H100; unmeasured)
#   scripts/gpu_acceptance.sh --dry-run [OUTDIR]  print what it would run, run nothing
#
# Needs the README install (.venv with the cu12 or cu13 extra and the test extra); PYTHON
# overrides the interpreter (default .venv/bin/python, else python3). Parts, in order, each
# with a time share (ACCEPT_BUDGET, default 1140 s, caps the total):
#   fresh-wheel  tests/test_fresh_wheel.py: a wheel installed with only the runtime extra
#                into a fresh venv, CUDA toolkit hidden, compiles every kernel with NVRTC
#   selfcheck    convfuse selfcheck --json OUTDIR/selfcheck.json
#   pytest-gpu   pytest tests/gpu -p fusion_strict (scripts/fusion_strict.py: a fallback from
#                a fused call where cuDNN documents it, conv + bias + activation or
#                BatchNorm + add + ReLU, fails the test), JUnit XML; every tests/gpu/test_*.py
#                file (ops, layers, BatchNorm, models, torch bridge, edge values, robustness)
#   benchmark    benchmarks/fused_vs_unfused.py, full run: JSON + PNG
#   syncs        scripts/count_syncs.py: device-to-host copies and syncs per training step,
#                eager and captured (nsys where present, else a capture probe); target zero
#   sanitizer    compute-sanitizer --tool memcheck on one eager step and one replay, if installed
# OUTDIR gets at most 8 files, each under 16 MB: summary.md (pass/fail per part, key
# numbers), selfcheck.json, pytest-gpu.xml, benchmark.json, benchmark.png, syncs.json,
# sanitizer.txt, log.txt. Without a GPU it prints the plan and exits 0, like --dry-run.
# Exit status: 0 when every part that ran passed, 1 otherwise.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
DRY=0
OUT=""
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) OUT=$arg ;;
  esac
done
if [ -z "$OUT" ] && [ "$DRY" = 0 ]; then
  echo "usage: scripts/gpu_acceptance.sh [--dry-run] OUTDIR" >&2
  exit 2
fi
OUT=${OUT:-acceptance-out}
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3; fi
BUDGET=${ACCEPT_BUDGET:-1140}
MAX_BYTES=$((16 * 1024 * 1024))

# name|time share in seconds|command (run from the checkout, with OUT set)
PARTS=(
  "fresh-wheel|150|$PY -m pytest -q -p no:cacheprovider tests/test_fresh_wheel.py"
  "selfcheck|180|$PY -m convfuse selfcheck --json \"\$OUT/selfcheck.json\""
  "pytest-gpu|420|PYTHONPATH=scripts:\${PYTHONPATH:-} $PY -m pytest -q -p no:cacheprovider -p fusion_strict tests/gpu --durations=25 --deselect tests/gpu/test_selfcheck_gpu.py::test_command_line_exits_zero_and_writes_json --junitxml \"\$OUT/pytest-gpu.xml\""
  "benchmark|180|PYTHONPATH=. $PY benchmarks/fused_vs_unfused.py --quiet --out \"\$OUT/benchmark.json\" --plot \"\$OUT/benchmark.png\""
  "syncs|90|$PY scripts/count_syncs.py --out \"\$OUT/syncs.json\""
  "sanitizer|120|compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 200 $PY scripts/count_syncs.py --worker --steps 1"
)

gpu_reason=$("$PY" -c 'from convfuse.backend import gpu_unavailable_reason as r; print(r() or "")' 2>&1)
if [ "$DRY" = 1 ] || [ -n "$gpu_reason" ]; then
  if [ "$DRY" = 1 ]; then echo "gpu_acceptance: dry run; nothing is executed."
  else echo "gpu_acceptance: no usable GPU ($gpu_reason); printing the plan only."; fi
  echo "It would write into $OUT (at most 8 files, each under 16 MB):"
  echo "  summary.md selfcheck.json pytest-gpu.xml benchmark.json benchmark.png syncs.json sanitizer.txt log.txt"
  echo "Parts, in order, with their time shares (total capped at ${BUDGET} s):"
  for part in "${PARTS[@]}"; do
    IFS='|' read -r name share cmd <<<"$part"
    printf '  %-12s %4ss  %s\n' "$name" "$share" "$cmd"
  done
  echo "  (sanitizer runs only if compute-sanitizer is on PATH; syncs uses nsys if on PATH)"
  echo "pytest-gpu collects these files:"
  for f in tests/gpu/test_*.py; do echo "  $f"; done
  echo "Then: $PY scripts/acceptance_summary.py \"\$OUT\" STATUS > summary.md"
  exit 0
fi

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export OUT
STATUS=$(mktemp)
LOG="$OUT/log.txt"
: >"$LOG"
start_all=$(date +%s)
for part in "${PARTS[@]}"; do
  IFS='|' read -r name share cmd <<<"$part"
  left=$((BUDGET - ($(date +%s) - start_all)))
  [ "$share" -gt "$left" ] && share=$left
  t0=$(date +%s)
  tool=${cmd%% *}
  if [ "$name" = sanitizer ] && ! command -v compute-sanitizer >/dev/null; then
    rc=127; echo "== $name: compute-sanitizer not installed, skipped" >>"$LOG"
  elif [ "$share" -le 0 ]; then
    rc=124; echo "== $name: no time left in the ${BUDGET} s budget" >>"$LOG"
  else
    echo "== $name ($share s): $cmd" >>"$LOG"
    part_log=$(mktemp)
    timeout --kill-after=15 "$share" bash -c "$cmd" >"$part_log" 2>&1
    rc=$?
    if [ "$name" = sanitizer ]; then
      head -c $((4 * 1024 * 1024)) "$part_log" >"$OUT/sanitizer.txt"
    fi
    # each part's log, its last 2 MB at most, so log.txt stays far below the cap
    tail -c $((2 * 1024 * 1024)) "$part_log" >>"$LOG"
    rm -f "$part_log"
  fi
  echo "$name $rc $(( $(date +%s) - t0 ))" >>"$STATUS"
  echo "gpu_acceptance: $name exit $rc after $(( $(date +%s) - t0 )) s"
done
for f in "$OUT"/*; do  # the 16 MB cap (nothing above should come near it)
  if [ -f "$f" ] && [ "$(stat -c %s "$f")" -ge "$MAX_BYTES" ]; then
    truncate -s $((MAX_BYTES - 1)) "$f"
  fi
done
"$PY" scripts/acceptance_summary.py "$OUT" "$STATUS"
failed=$(awk '$2 != 0 && $2 != 127' "$STATUS" | wc -l)
rm -f "$STATUS"
[ "$failed" -eq 0 ]
