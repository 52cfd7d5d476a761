"""The parts of each stage of scripts/gpu_acceptance.sh, sized from the tests collected now.

  python scripts/acceptance_plan.py --dry-run [--stage N]       print every stage's parts
  python scripts/acceptance_plan.py --stage N --parts FILE      write stage N's parts

Every tests/gpu file lands in exactly one pytest chunk (a file no chunk names goes to the
last one). A chunk of N tests is guaranteed `ceil(15 + 0.1 N)` seconds: 15 s for its
process (imports, CUDA context, cuDNN's lazy loading) and 0.1 s per test, a planning figure
for an H100 until a GPU run's tests.jsonl gives real ones (docs/VERIFYING.md section 7).
The selfcheck chunk also gets SELFCHECK_RUN_S for the whole selfcheck its fixture runs.

Packing, in order of value: every chunk goes into the first stage (from the previous
chunk's on) whose minimums still fit its cap; a chunk too big for any stage is split by
files; then the tail parts (syncs, the host-overhead benchmark, the other benchmarks,
sanitizer) the same way, never before stage 2. A lease of 15 minutes runs two stages
(two 300 s commands and a machine start), so at most MAX_STAGES stages are allowed:
more, and the plan fails loudly (exit 1).

Collection is `python -m pytest --collect-only -q tests/gpu`, which needs no GPU and no
built binding; ACCEPT_COLLECTED names a file holding that output instead (the CPU tests).
Parts are lines `name|cap|gpu|command` (caps: N, N-M at least N and up to M, N+ at least
N and all the time left), read by gpu_acceptance.sh, which runs its own install and plan
parts first (INSTALL_PART, PLAN_PART in the environment: their minimums are reserved). A
clean collection is kept in .cache/acceptance/ (ignored), keyed by the tests, the package
and the interpreter, so a warm tree's next stage plans without collecting again.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import math
import os
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU_TESTS = "tests/gpu"
PER_TEST_S = 0.1
CHUNK_PROCESS_S = 15
SELFCHECK_RUN_S = 60  # the fixture's convfuse.selfcheck.run(): NVRTC, every case x dtype
MAX_STAGES = 4  # two leases of two stages
TAIL_FIRST_STAGE = 2

# Chunks in order of value: the fused paths, layers, training step and torch bridge; the
# op grid; BatchNorm and the kernel grids; the rest. The last named chunk also takes every
# file no chunk names, so a new file runs without an edit here.
CHUNKS: list[tuple[str, list[str]]] = [
    ("gpu-core", ["test_binding_gpu_handle.py", "test_fused_path_gpu.py", "test_layers_gpu.py",
                  "test_graph_gpu.py", "test_optim_gpu.py", "test_torch_gpu.py",
                  "test_torch_bound_calls_gpu.py", "test_torch_batchnorm_gpu.py",
                  "test_models_gpu.py", "test_loss_gpu.py"]),
    ("gpu-ops", ["test_cudnn_ops.py"]),
    ("gpu-bn", ["test_batchnorm_gpu.py", "test_elementwise_gpu.py", "test_edge_values_gpu.py",
                "test_robust_gpu.py"]),
    # the torch bridge's default CUDA path, its autocast and converted blocks, and the
    # transposed and padded convolutions: before the grids of the rest
    ("gpu-torch", ["test_torch_pointer_path_gpu.py", "test_torch_opcheck_gpu.py",
                   "test_torch_autocast_gpu.py", "test_torch_convert_blocks_gpu.py",
                   "test_conv_transpose_gpu.py", "test_padding_gpu.py"]),
    ("gpu-rest", ["test_fused_fallback_gpu.py", "test_binding_gpu_conv.py",
                  "test_binding_gpu_conv_fused.py", "test_binding_gpu_conv_layouts.py",
                  "test_binding_gpu_activation_pooling.py", "test_distributed_gpu.py"]),
]
# The selfcheck runs in a chunk of its own with no per-test timeout (its cap governs, and a
# cut there is a cut, not a failure): its module fixture runs the whole selfcheck, far
# past the 45 s other tests get, and pytest-timeout's thread method would end the chunk. Its
# command-line test reruns all of it in a subprocess; the CPU suite covers the command line.
SELFCHECK = "test_selfcheck_gpu.py"
# Files with tests that compile with Inductor or dynamo on a cold cache (tens of seconds
# each; those tests carry a timeout marker of their own): last in their chunk, so that a
# compile that still outruns its timeout (pytest-timeout's thread method ends the chunk)
# cuts nothing after it.
COMPILE_LAST = ("test_torch_conv_transpose_gpu.py", "test_torch_backend_gpu.py",
                "test_torch_graphs_gpu.py")
# NCCL, which a sandboxed machine may fail to start or hang in (tests/gpu/
# test_distributed_gpu.py): after even the compiles, the very last of its chunk.
LAST = "test_distributed_gpu.py"
SELFCHECK_DESELECT = "test_command_line_exits_zero_and_writes_json"


@dataclass
class Part:
    name: str
    lo: int
    hi: int | None  # None: all the time left ("N+")
    gpu: bool
    command: str
    tests: int | None = None  # pytest chunks only
    files: list[str] = field(default_factory=list)

    @property
    def cap(self) -> str:
        if self.hi is None:
            return f"{self.lo}+"
        return str(self.lo) if self.hi == self.lo else f"{self.lo}-{self.hi}"

    def line(self) -> str:
        return f"{self.name}|{self.cap}|{'yes' if self.gpu else 'no'}|{self.command}"


def head_parts(stage: int) -> list[Part]:
    """What a stage runs before its chunks, after the script's own install and plan parts
    (the install comes first: collecting tests/gpu imports the built binding)."""
    if stage == 1:
        return [Part("smoke", 40, 90, False,
                     '"$PY" scripts/gpu_smoke.py --json "$OUT/smoke.json"')]
    return []


def tail_parts(bench_sections: str) -> list[Part]:
    bench_sections = ",".join(s for s in bench_sections.split(",") if s != "host-overhead")
    return [
        Part("syncs", 10, 25, True, '"$PY" scripts/count_syncs.py --steps 5 --out '
             '"$OUT/syncs.json"'),
        # Issue 25's GPU figure (host time per fused call against PyTorch eager) in the
        # first lease: the host-overhead section alone, appended to bench.jsonl as the
        # benchmarks' sections are (`bench` then leaves it out).
        Part("host", 25, 60, True,
             '"$PY" benchmarks/fused_vs_unfused.py --quick --quiet --sections host-overhead '
             '--no-conv-transpose --stream "$OUT/bench.jsonl" --out "$SCRATCH/host.json" '
             '--plot "$SCRATCH/host.png"'),
        # The sections stream one by one, so a cut run keeps the finished ones; `compile`
        # (ResNet-18 through Inductor twice) is the last section and the likeliest cut.
        Part("bench", 150, 260, True,
             f'"$PY" benchmarks/fused_vs_unfused.py --quick --quiet --sections '
             f'{bench_sections} --resnet --stream "$OUT/bench.jsonl" '
             f'--out "$SCRATCH/bench.json" --plot "$SCRATCH/bench.png"'),
        Part("sanitizer", 0, None, True, "sanitizer"),
    ]


def _collection_key(root: Path) -> str:
    """What the collected tests depend on: every Python file of the tests and the package,
    and the interpreter."""
    h = hashlib.sha256(f"{sys.executable} {sys.version}".encode())
    for path in sorted([*root.glob("tests/**/*.py"), *root.glob("convfuse/**/*.py"),
                        *root.glob("convfuse/_cudnn*.so"), root / "pyproject.toml"]):
        with contextlib.suppress(OSError):
            h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def collect(root: Path = ROOT, cache: Path | None = None) -> tuple[Counter, str]:
    """Tests per tests/gpu file, and the collection's error text (empty when clean). A
    clean collection is kept in `cache` with its key, so a warm tree's next stage plans
    without collecting again."""
    given = os.environ.get("ACCEPT_COLLECTED")
    key = _collection_key(root) if cache and not given else ""
    if given:
        text, errors = Path(given).read_text(), ""
    elif cache and cache.is_file() and cache.read_text().startswith(key + "\n"):
        text, errors = cache.read_text(), ""
        print(f"(collection reused from {cache.relative_to(root)})")
    else:
        proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                               "-p", "no:cacheprovider", GPU_TESTS], cwd=root,
                              capture_output=True, text=True)
        text = proc.stdout
        errors = "" if proc.returncode == 0 else (proc.stdout[-3000:] + proc.stderr[-2000:])
        if cache and not errors:
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(key + "\n" + text)
    counts: Counter = Counter()
    for line in text.splitlines():
        if "::" in line and line.startswith(GPU_TESTS + "/"):
            counts[line.split("::", 1)[0]] += 1
    if not given and not counts and not errors:
        errors = "no test collected"
    return counts, errors


def chunk_minimum(tests: int, extra: int = 0) -> int:
    return math.ceil(CHUNK_PROCESS_S + PER_TEST_S * tests + extra)


def _chunk(name: str, files: list[str], counts: Counter, extra: int = 0,
           opts: str = "", deselected: int = 0) -> Part:
    n = sum(counts.get(f, 0) for f in files) - deselected
    env = "CHUNK_TEST_TIMEOUT=0 " if extra else ""
    cmd = f"{env}chunk {name} {n} {' '.join(files)}{opts}"
    return Part(name, chunk_minimum(n, extra), None, True, cmd, tests=n, files=files)


def chunks(counts: Counter, files: list[str]) -> list[Part]:
    """The pytest chunks over every file in `files` (the tests/gpu/test_*.py paths)."""
    named = {f"{GPU_TESTS}/{f}" for _, fs in CHUNKS for f in fs} | {f"{GPU_TESTS}/{SELFCHECK}"}
    out = []
    for i, (name, fs) in enumerate(CHUNKS):
        paths = [f"{GPU_TESTS}/{f}" for f in fs if f"{GPU_TESTS}/{f}" in files]
        if i == len(CHUNKS) - 1:
            paths += sorted(f for f in files if f not in named)
        # stable: the rest in order, then the compiles, then NCCL
        paths.sort(key=lambda p: (Path(p).name == LAST, Path(p).name in COMPILE_LAST))
        if paths:
            out.append(_chunk(name, paths, counts))
    selfcheck = f"{GPU_TESTS}/{SELFCHECK}"
    if selfcheck in files:
        out.append(_chunk("gpu-selfcheck", [selfcheck], counts, SELFCHECK_RUN_S,
                          f" --deselect {selfcheck}::{SELFCHECK_DESELECT}",
                          deselected=1 if counts.get(selfcheck) else 0))
    return out


def split(part: Part, counts: Counter, room: int) -> list[Part]:
    """A chunk too big for `room` as consecutive pieces by file, each fitting `room`."""
    pieces: list[list[str]] = [[]]
    for f in part.files:
        trial = pieces[-1] + [f]
        if pieces[-1] and chunk_minimum(sum(counts.get(g, 0) for g in trial)) > room:
            pieces.append([f])
        else:
            pieces[-1] = trial
    return [_chunk(f"{part.name}-{i}", fs, counts) for i, fs in enumerate(pieces, 1)]


@dataclass
class Plan:
    stages: dict[int, list[Part]]
    room: int
    errors: list[str]

    def used(self, stage: int) -> int:
        return sum(p.lo for p in self.stages.get(stage, []))


def pack(counts: Counter, files: list[str], room: int, bench_sections: str) -> Plan:
    """Every part of every stage; `room` is a stage's seconds less the minimums of the
    script's install and plan parts and the reserve for the last summary."""
    plan = Plan({}, room, [])

    def new_stage(stage: int) -> None:
        plan.stages.setdefault(stage, head_parts(stage))

    def place(part: Part, first: int) -> int:
        stage = first
        new_stage(stage)
        while plan.used(stage) + part.lo > room:
            stage += 1
            new_stage(stage)
            if plan.used(stage) + part.lo > room:  # too big even for an empty stage
                plan.errors.append(f"{part.name} needs {part.lo} s; a stage has "
                                   f"{room - plan.used(stage)} s for it")
                break
        plan.stages[stage].append(part)
        return stage

    stage = 1
    empty_room = room - sum(p.lo for p in head_parts(2))
    for part in chunks(counts, files):
        pieces = [part]
        if part.lo > empty_room and part.tests is not None and len(part.files) > 1:
            pieces = split(part, counts, empty_room)
        for piece in pieces:
            stage = place(piece, stage)
    stage = max(stage, TAIL_FIRST_STAGE)
    for part in tail_parts(bench_sections):
        stage = place(part, stage)
    if len(plan.stages) > MAX_STAGES:
        plan.errors.append(f"the parts need {len(plan.stages)} stages; at most {MAX_STAGES} "
                           "(two leases) are planned for: split the chunks or trim the tests")
    return plan


def gpu_test_files(root: Path = ROOT) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in (root / GPU_TESTS).glob("test_*.py"))


def make_plan(stage_cap: int, reserve: int, fixed_s: int, bench_sections: str,
              cache: Path | None = None) -> tuple[Plan, Counter, str]:
    counts, errors = collect(cache=cache)
    plan = pack(counts, gpu_test_files(), stage_cap - reserve - fixed_s, bench_sections)
    return plan, counts, errors


def leases(plan: Plan) -> list[list[int]]:
    stages = sorted(plan.stages)
    return [stages[i:i + 2] for i in range(0, len(stages), 2)]


def print_dry_run(plan: Plan, counts: Counter, only: int | None, stage_cap: int,
                  fixed: list[str]) -> None:
    total = sum(counts.values())
    print(f"collected {total} tests in {GPU_TESTS}; a chunk of N tests is guaranteed "
          f"{CHUNK_PROCESS_S} s + {PER_TEST_S} s x N (estimates until a GPU run's tests.jsonl)")
    for stage in sorted(plan.stages):
        for p in plan.stages[stage]:
            if p.tests is not None:
                print(f"chunk {p.name}: {p.tests} tests, at least {p.lo} s")
    for stage in sorted(plan.stages):
        if only is not None and stage != only:
            continue
        print(f"stage {stage} parts (name, cap, needs a GPU, command):")
        rows = [line.split("|", 3) for line in fixed]
        rows += [[p.name, p.cap, "yes" if p.gpu else "no", p.command]
                 for p in plan.stages[stage]]
        for name, cap, gpu, cmd in rows:
            print(f"  {name:<14} {cap:>7} s  gpu={gpu:<3}  {cmd}")
    for stage in sorted(plan.stages):
        if only is None or stage == only:
            lo = plan.used(stage) + sum(map(_minimum, fixed))
            print(f"stage {stage}: cap {stage_cap} s, minimums {lo} s")
    for i, group in enumerate(leases(plan), 1):
        print(f"lease {i}: stages {' '.join(map(str, group))}")


def _minimum(part_line: str) -> int:
    return int(part_line.split("|")[1].split("-")[0].rstrip("+"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", type=int)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--parts", type=Path, help="write the stage's parts here")
    # gpu_acceptance.sh exports these; the defaults are its values
    env = os.environ.get
    p.add_argument("--stage-cap", type=int, default=int(env("STAGE_CAP", "295")))
    p.add_argument("--reserve", type=int, default=int(env("RESERVE", "5")))
    p.add_argument("--bench-sections", default=env("BENCH_SECTIONS",
                                                   "forward,biasgrad,adam,train"))
    a = p.parse_args(argv)
    # the script's own parts, before the planned ones
    a.fixed = [env("INSTALL_PART", "install|30-240|no|offline_install"),
               env("PLAN_PART", "plan|20-60|no|plan")]
    cache = None if a.dry_run else ROOT / ".cache" / "acceptance" / "collected.txt"
    plan, counts, errors = make_plan(a.stage_cap, a.reserve, sum(map(_minimum, a.fixed)),
                                     a.bench_sections, cache)
    if errors:
        print(f"pytest --collect-only {GPU_TESTS} reported errors (files with errors count "
              f"0 tests here and run anyway):\n{errors}", file=sys.stderr)
    if a.dry_run:
        print_dry_run(plan, counts, a.stage, a.stage_cap, a.fixed)
    else:
        parts = plan.stages.get(a.stage or 0, [])
        for part in parts:
            if part.tests is not None:
                print(f"chunk {part.name}: {part.tests} tests, at least {part.lo} s")
        if a.parts:
            a.parts.write_text("".join(part.line() + "\n" for part in parts))
        if not parts:
            print(f"stage {a.stage}: nothing planned (the plan has stages "
                  f"{', '.join(map(str, sorted(plan.stages)))})")
    for error in plan.errors:
        print(f"acceptance_plan: {error}", file=sys.stderr)
    return 1 if plan.errors or errors else 0


if __name__ == "__main__":
    sys.exit(main())
