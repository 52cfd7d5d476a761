#!/usr/bin/env bash
# Run the binding and leak tests under AddressSanitizer (+ LeakSanitizer) and valgrind memcheck.
#
#   scripts/sanitize.sh [asan|valgrind|all]     (default: all)
#
# Environment: PYTHON (default: python3 on PATH; use the project's venv), SANITIZE_DIR (scratch
# folder, default a new mktemp dir), VALGRIND_CYCLES (leak-test cycles under valgrind, 500).
#
# asan: copies convfuse/, csrc/, tests/, docs/, scripts/, setup.py, pyproject.toml to a scratch folder; builds
#   convfuse._cudnn there with -fsanitize=address (the checkout's own build is untouched), and
#   runs the binding tests (tests/test_binding_*.py) and tests/test_leaks.py against that build with:
#   - LD_PRELOAD of libasan and libstdc++: python is not built with ASan, and ASan's __cxa_throw
#     interceptor needs libstdc++ loaded before the extension throws its first exception;
#   - LD_LIBRARY_PATH to the cuDNN wheel's lib/: ASan's dlopen interceptor hides libcudnn's
#     RUNPATH, so its shim can no longer find libcudnn_graph.so.9 beside itself;
#   - PYTHONMALLOC=malloc, so every Python object lives in memory ASan tracks;
#   - ASAN_OPTIONS protect_shadow_gap=0: the CUDA driver maps memory inside ASan's shadow
#     gap, so with it protected CUDA cannot initialise and, on a GPU machine, the tests would
#     quietly take their no-GPU branches;
#   - -Wno-maybe-uninitialized: with -fsanitize=address GCC 12 reports a false positive in
#     pybind11's small_vector, which the build's -Werror would turn into an error.
#   LeakSanitizer's report is sorted by scripts/sanitizer_report.py: leaks whose stack passes
#   through convfuse._cudnn fail the run; the interpreter's own leaks at exit are counted only.
# valgrind: runs the same two test files on the regular build under memcheck (--leak-check=full),
#   with fewer leak-test cycles, and sorts the log the same way.
set -euo pipefail

MODE=${1:-all}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
WORK=${SANITIZE_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/convfuse-sanitize.XXXXXX")}
TESTS=(tests/test_binding_library.py tests/test_binding_descriptors.py tests/test_binding_shapes.py tests/test_binding_lifetime_and_errors.py tests/test_binding_batchnorm.py tests/test_leaks.py)
CUDNN_LIB=$("$PY" -c 'import os; from cuda.pathfinder import load_nvidia_dynamic_lib as l; print(os.path.dirname(l("cudnn").abs_path))')
STATUS=0

echo "scratch folder: $WORK"
echo "python: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
echo "cuDNN: $CUDNN_LIB"

run_asan() {
  local src="$WORK/asan-src"
  rm -rf "$src" && mkdir -p "$src"
  cp -r "$ROOT/convfuse" "$ROOT/csrc" "$ROOT/tests" "$ROOT/docs" "$ROOT/scripts" "$ROOT/setup.py" \
    "$ROOT/pyproject.toml" "$src/"
  find "$src" \( -name '*.so' -o -name '__pycache__' \) -prune -exec rm -rf {} +
  echo "== building convfuse._cudnn with -fsanitize=address (slow: a few minutes)"
  (cd "$src" && CFLAGS="-fsanitize=address -fno-omit-frame-pointer -g -Wno-maybe-uninitialized" \
     LDFLAGS="-fsanitize=address" "$PY" setup.py -q build_ext --inplace --build-temp "$WORK/asan-build" \
     > "$WORK/asan-build.log" 2>&1) || { tail -20 "$WORK/asan-build.log"; return 1; }
  local so
  so=$(ls "$src"/convfuse/_cudnn*.so)
  # grep reads all of ldd's output (grep -q would stop at the match, and ldd's SIGPIPE would
  # fail the pipeline under pipefail: "not an ASan build" for one that is)
  ldd "$so" | grep libasan > /dev/null || { echo "not an ASan build: $so"; return 1; }
  local preload
  preload="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)"
  rm -f "$WORK"/asan.log.*
  echo "== pytest ${TESTS[*]} under ASan"
  local rc=0
  (cd "$src" && env LD_PRELOAD="$preload" LD_LIBRARY_PATH="$CUDNN_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
     PYTHONMALLOC=malloc \
     ASAN_OPTIONS="detect_leaks=1:halt_on_error=1:detect_stack_use_after_return=1:protect_shadow_gap=0:log_path=$WORK/asan.log" \
     LSAN_OPTIONS="exitcode=0" \
     "$PY" -c 'import convfuse._binding as b, sys; m = b.cudnn(); print("extension:", m.__file__)' \
     && env LD_PRELOAD="$preload" LD_LIBRARY_PATH="$CUDNN_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
     PYTHONMALLOC=malloc \
     ASAN_OPTIONS="detect_leaks=1:halt_on_error=1:detect_stack_use_after_return=1:protect_shadow_gap=0:log_path=$WORK/asan.log" \
     LSAN_OPTIONS="exitcode=0" \
     "$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}") || rc=$?
  local logs=("$WORK"/asan.log.*)
  if [ -e "${logs[0]}" ]; then
    "$PY" "$ROOT/scripts/sanitizer_report.py" asan "${logs[@]}" || rc=1
  else
    echo "ASan: no report written (no memory errors, no leaks at exit)"
  fi
  return $rc
}

run_valgrind() {
  command -v valgrind > /dev/null || { echo "valgrind is not installed"; return 1; }
  local log="$WORK/valgrind.log"
  echo "== pytest ${TESTS[*]} under valgrind memcheck (slow: several minutes)"
  local rc=0
  (cd "$ROOT" && env PYTHONMALLOC=malloc CONVFUSE_LEAK_CYCLES="${VALGRIND_CYCLES:-500}" \
     valgrind --tool=memcheck --leak-check=full --show-leak-kinds=definite \
     --errors-for-leak-kinds=definite --num-callers=40 --log-file="$log" \
     "$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}") || rc=$?
  "$PY" "$ROOT/scripts/sanitizer_report.py" valgrind "$log" || rc=1
  return $rc
}

case "$MODE" in
  asan) run_asan || STATUS=1 ;;
  valgrind) run_valgrind || STATUS=1 ;;
  all) run_asan || STATUS=1; run_valgrind || STATUS=1 ;;
  *) echo "usage: $0 [asan|valgrind|all]" >&2; exit 2 ;;
esac

if [ "$STATUS" -eq 0 ]; then echo "sanitize.sh $MODE: CLEAN"; else echo "sanitize.sh $MODE: FAILED"; fi
exit "$STATUS"
