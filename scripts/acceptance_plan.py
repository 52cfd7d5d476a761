"""The parts of each stage of scripts/gpu_acceptance.sh, sized from the tests collected now.

  python scripts/acceptance_plan.py --dry-run [--stage N]       print every stage's parts
  python scripts/acceptance_plan.py --stage N --parts FILE      write stage N's parts

Every tests/gpu file lands in exactly one pytest chunk (a file no chunk names goes to the
last one). A chunk of N tests is guaranteed `ceil(15 + 0.1 N)` seconds: 15 s for its
process (imports, CUDA context, cuDNN's lazy loading) and 0.1 s per test, a planning figure
for an H100 until a GPU run's tests.jsonl gives real ones (docs/VERIFYING.md section 7).
The selfcheck chunk also gets SELFCHECK_RUN_S for the whole selfcheck its fixture runs.
A test whose own timeout marker allows more than COLD_COMPILE_S (tests/conftest.py's: a
cold Inductor compile, an NCCL start) is deselected from its chunk and runs in `gpu-cold`,
planned at COLD_TEST_S each, never in lease 1.

Packing, in order of value: stage 1 starts with the smoke test, stage 2 with the host time
per call and the sync count (issue 25's GPU figures: first, so nothing before them can cut
them); every chunk goes into the first stage (from the previous chunk's on) whose minimums
still fit; a chunk too big for any stage is split by files; then gpu-cold (from stage 3,
lease 2, on) and the benchmarks with the sanitizer (from stage 2 on, after the last
chunk's stage) each into the first stage where it fits. A
lease of 15 minutes runs two stages, so at most MAX_STAGES stages are allowed: more, and
the plan fails loudly (exit 1). Stages are always packed for PLAN_STAGE_CAP seconds, so a
stage holds the same parts whatever cap a session runs it with (ACCEPT_STAGE_CAP, which
the dry run compares with each stage's minimums).

Collection is `python -m pytest --collect-only -q tests/gpu` with this module as a plugin
(it adds a `cold-test TIMEOUT NODEID` line per cold test), which needs no GPU and no built
binding; ACCEPT_COLLECTED names a file holding that output instead (the CPU tests).
Parts are lines `name|cap|gpu|command` (caps: N, N-M at least N and up to M, N+ at least
N and all the time left), read by gpu_acceptance.sh, which runs its own install and plan
parts first (INSTALL_PART, PLAN_PART in the environment: their minimums are reserved). A
clean collection is kept in .cache/acceptance/ (ignored), keyed by the tests, the package,
this planner and the interpreter, so a warm tree's next stage plans without collecting
again.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import math
import os
import re
import shlex
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_acceptance.sh"
GPU_TESTS = "tests/gpu"
PER_TEST_S = 0.1
CHUNK_PROCESS_S = 15
SELFCHECK_RUN_S = 60  # the fixture's convfuse.selfcheck.run(): NVRTC, every case x dtype
PLAN_STAGE_CAP = 295  # the stage every plan is packed for (gpu_acceptance.sh's default cap)
MAX_STAGES = 4  # two leases of two stages
STAGES_PER_LEASE = 2
TAIL_FIRST_STAGE = 2  # the benchmarks and the sanitizer: after stage 1's smoke and tests
COLD_FIRST_STAGE = 3  # gpu-cold: lease 2
# A test whose timeout marker allows more than this is cold (tests/conftest.py's
# COLD_COMPILE_S, which sorts such tests last; a CPU test keeps the two equal)
COLD_COMPILE_S = 60
# Planned per cold test: an average, not a bound. A cold Inductor compile of a two-layer
# model takes tens of seconds and ResNet-18's forward and backward more; a world-one NCCL
# start a few seconds. Each test's own marker (240 s, 90 s) still ends one that hangs, and
# the chunk takes all the time its stage has left. Set it from a GPU run's tests.jsonl.
COLD_TEST_S = 30
COLD_PREFIX = "cold-test "

# Chunks in order of value: the fused paths, layers, training step and torch bridge; the
# op grid; BatchNorm and the kernel grids; the rest. The last named chunk also takes every
# file no chunk names, so a new file runs without an edit here.
CHUNKS: list[tuple[str, list[str]]] = [
    ("gpu-core", ["test_binding_gpu_handle.py", "test_fused_path_gpu.py", "test_layers_gpu.py",
                  "test_graph_gpu.py", "test_optim_gpu.py", "test_torch_gpu.py",
                  "test_torch_bound_calls_gpu.py", "test_torch_batchnorm_gpu.py",
                  "test_models_gpu.py", "test_loss_gpu.py",
                  # the README's main job (two short runs), last: an overrun cuts only it
                  "test_examples_gpu.py"]),
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
    files: list[str] = field(default_factory=list)  # the files a chunk runs
    deselect: list[str] = field(default_factory=list)  # node ids it leaves to gpu-cold

    @property
    def cap(self) -> str:
        if self.hi is None:
            return f"{self.lo}+"
        return str(self.lo) if self.hi == self.lo else f"{self.lo}-{self.hi}"

    def line(self) -> str:
        return f"{self.name}|{self.cap}|{'yes' if self.gpu else 'no'}|{self.command}"


HOST = Part(
    # Issue 25's GPU figures (host time per fused call against PyTorch eager, ResNet-18
    # steps eager and captured): first in stage 2, so no part before them can cut them.
    # The section streams to bench.jsonl; its full JSON (--from-json re-renders it) is
    # host.json, in OUTDIR. About 35-65 s measured time: 50 s guaranteed, up to 120 s.
    "host", 50, 120, True,
    '"$PY" benchmarks/fused_vs_unfused.py --quick --sections host-overhead '
    '--no-conv-transpose --stream "$OUT/bench.jsonl" --out "$OUT/host.json" '
    '--plot "$SCRATCH/host.png"')
SYNCS = Part("syncs", 10, 25, True,
             '"$PY" scripts/count_syncs.py --steps 5 --out "$OUT/syncs.json"')


def head_parts(stage: int) -> list[Part]:
    """What a stage runs before its chunks, after the script's own install and plan parts
    (the install comes first: collecting tests/gpu imports the built binding)."""
    if stage == 1:
        return [Part("smoke", 40, 90, False,
                     '"$PY" scripts/gpu_smoke.py --json "$OUT/smoke.json"')]
    if stage == 2:
        return [Part(**vars(HOST)), Part(**vars(SYNCS))]
    return []


def tail_parts(bench_sections: str) -> list[Part]:
    """The benchmarks and the sanitizer (from stage TAIL_FIRST_STAGE on)."""
    bench_sections = ",".join(s for s in bench_sections.split(",") if s != "host-overhead")
    return [
        # The sections stream one by one, so a cut run keeps the finished ones; `compile`
        # (ResNet-18 through Inductor twice) is the last section and the likeliest cut.
        # host-overhead ran in stage 2 (HOST): left out here. The full JSON is bench.json.
        Part("bench", 150, 260, True,
             f'"$PY" benchmarks/fused_vs_unfused.py --quick --sections '
             f'{bench_sections} --resnet --stream "$OUT/bench.jsonl" '
             f'--out "$OUT/bench.json" --plot "$SCRATCH/bench.png"'),
        Part("sanitizer", 0, None, True, "sanitizer"),
    ]


def _collection_key(root: Path) -> str:
    """What the collected tests depend on: every Python file of the tests and the package,
    and the interpreter."""
    h = hashlib.sha256(f"{sys.executable} {sys.version}".encode())
    for path in sorted([*root.glob("tests/**/*.py"), *root.glob("convfuse/**/*.py"),
                        *root.glob("convfuse/_cudnn*.so"), root / "pyproject.toml",
                        Path(__file__).resolve()]):
        with contextlib.suppress(OSError):
            h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def pytest_collection_finish(session) -> None:  # the collection's plugin: -p acceptance_plan
    """One `cold-test TIMEOUT NODEID` line per collected test whose timeout marker allows
    more than COLD_COMPILE_S."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    for item in session.items:
        timeout = cold_timeout(item.get_closest_marker("timeout"))
        if timeout is not None:
            line = f"{COLD_PREFIX}{timeout:g} {item.nodeid}"
            if reporter is not None:
                reporter.write_line(line)
            else:
                print(line)


def cold_timeout(mark) -> float | None:
    """A timeout marker's seconds where they exceed COLD_COMPILE_S, else None."""
    if mark is None:
        return None
    value = mark.args[0] if mark.args else mark.kwargs.get("timeout")
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return None
    return seconds if seconds > COLD_COMPILE_S else None


@dataclass
class Collected:
    counts: Counter  # tests per tests/gpu file
    cold: list[str]  # the cold tests' node ids, in collection order
    errors: str  # the collection's error text (empty when clean)


def collect(root: Path = ROOT, cache: Path | None = None) -> Collected:
    """The collected tests. A clean collection is kept in `cache` with its key, so a warm
    tree's next stage plans without collecting again."""
    given = os.environ.get("ACCEPT_COLLECTED")
    key = _collection_key(root) if cache and not given else ""
    if given:
        text, errors = Path(given).read_text(), ""
    elif cache and cache.is_file() and cache.read_text().startswith(key + "\n"):
        text, errors = cache.read_text(), ""
        print(f"(collection reused from {cache.relative_to(root)})")
    else:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(Path(__file__).resolve().parent), env.get("PYTHONPATH")]))
        proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                               "-p", "no:cacheprovider", "-p", Path(__file__).stem,
                               GPU_TESTS], cwd=root, capture_output=True, text=True, env=env)
        text = proc.stdout
        errors = "" if proc.returncode == 0 else (proc.stdout[-3000:] + proc.stderr[-2000:])
        if cache and not errors:
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(key + "\n" + text)
    counts: Counter = Counter()
    cold: list[str] = []
    for line in text.splitlines():
        if line.startswith(COLD_PREFIX):
            nodeid = line[len(COLD_PREFIX):].split(" ", 1)[-1]
            if nodeid.startswith(GPU_TESTS + "/") and nodeid not in cold:
                cold.append(nodeid)
        elif "::" in line and line.startswith(GPU_TESTS + "/"):
            counts[line.split("::", 1)[0]] += 1
    if not given and not counts and not errors:
        errors = "no test collected"
    return Collected(counts, cold, errors)


def chunk_minimum(tests: int, extra: int = 0) -> int:
    return math.ceil(CHUNK_PROCESS_S + PER_TEST_S * tests + extra)


def _in(nodeid: str, files: list[str]) -> bool:
    return nodeid.split("::", 1)[0] in files


def _chunk(name: str, files: list[str], counts: Counter, cold: Sequence[str] = (),
           extra: int = 0, opts: str = "", deselected: int = 0) -> Part:
    """A chunk over `files`, less the cold tests among them (each deselected by its node
    id: they run in gpu-cold)."""
    leave = [c for c in cold if _in(c, files)]
    n = sum(counts.get(f, 0) for f in files) - deselected - len(leave)
    env = "CHUNK_TEST_TIMEOUT=0 " if extra else ""
    opts += "".join(f" --deselect {shlex.quote(c)}" for c in leave)
    cmd = f"{env}chunk {name} {n} {' '.join(files)}{opts}"
    return Part(name, chunk_minimum(n, extra), None, True, cmd, tests=n, files=files,
                deselect=leave)


def chunks(counts: Counter, files: list[str], cold: Sequence[str] = ()) -> list[Part]:
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
            out.append(_chunk(name, paths, counts, cold))
    selfcheck = f"{GPU_TESTS}/{SELFCHECK}"
    if selfcheck in files:
        out.append(_chunk("gpu-selfcheck", [selfcheck], counts, cold, SELFCHECK_RUN_S,
                          f" --deselect {selfcheck}::{SELFCHECK_DESELECT}",
                          deselected=1 if counts.get(selfcheck) else 0))
    return out


def cold_minimum(tests: int) -> int:
    return math.ceil(CHUNK_PROCESS_S + COLD_TEST_S * tests)


def cold_parts(cold: list[str], room: int) -> list[Part]:
    """The cold tests by node id, the compiles first and NCCL last (a hang there ends the
    process: nothing may come after it), in pieces that each fit `room`."""
    ordered = sorted(cold, key=lambda c: Path(c.split("::", 1)[0]).name == LAST)  # stable
    pieces: list[list[str]] = [[]]
    for nodeid in ordered:
        if pieces[-1] and cold_minimum(len(pieces[-1]) + 1) > room:
            pieces.append([])
        pieces[-1].append(nodeid)
    out = []
    for i, ids in enumerate(p for p in pieces if p):
        name = "gpu-cold" if len(pieces) == 1 else f"gpu-cold-{i + 1}"
        cmd = f"chunk {name} {len(ids)} " + " ".join(map(shlex.quote, ids))
        out.append(Part(name, cold_minimum(len(ids)), None, True, cmd, tests=len(ids)))
    return out


def split(part: Part, counts: Counter, room: int) -> list[Part]:
    """A chunk too big for `room` as consecutive pieces by file, each fitting `room`."""
    def minimum(files: list[str]) -> int:
        return chunk_minimum(sum(counts.get(g, 0) for g in files)
                             - sum(_in(c, files) for c in part.deselect))

    pieces: list[list[str]] = [[]]
    for f in part.files:
        trial = pieces[-1] + [f]
        if pieces[-1] and minimum(trial) > room:
            pieces.append([f])
        else:
            pieces[-1] = trial
    return [_chunk(f"{part.name}-{i}", fs, counts, part.deselect)
            for i, fs in enumerate(pieces, 1)]


@dataclass
class Plan:
    stages: dict[int, list[Part]]
    room: int
    errors: list[str]

    def used(self, stage: int) -> int:
        return sum(p.lo for p in self.stages.get(stage, []))

    def stage_of(self, name: str) -> int | None:
        return next((s for s, parts in self.stages.items() for p in parts if p.name == name),
                    None)


def pack(counts: Counter, files: list[str], room: int, bench_sections: str,
         cold: Sequence[str] = ()) -> Plan:
    """Every part of every stage; `room` is a stage's seconds less the minimums of the
    script's install and plan parts and the reserve for the last summary."""
    plan = Plan({}, room, [])

    def new_stage(stage: int) -> None:
        plan.stages.setdefault(stage, head_parts(stage))

    empty_room = room - min(sum(p.lo for p in head_parts(s)) for s in range(1, MAX_STAGES + 1))

    def place(part: Part, first: int) -> int:
        if part.lo > empty_room:  # too big even for an empty stage: a stage of its own
            plan.errors.append(f"{part.name} needs {part.lo} s; a stage has {empty_room} s "
                               "for it")
            stage = max([first - 1, *plan.stages]) + 1
            new_stage(stage)
        else:
            stage = first
            new_stage(stage)
            while plan.used(stage) + part.lo > room:
                stage += 1
                new_stage(stage)
        plan.stages[stage].append(part)
        return stage

    stage = 1
    for part in chunks(counts, files, cold):
        pieces = [part]
        if part.lo > empty_room and part.tests is not None and len(part.files) > 1:
            pieces = split(part, counts, empty_room)
        for piece in pieces:
            stage = place(piece, stage)
    # each where it first fits, gpu-cold from lease 2 on; the sanitizer (all the time
    # left) after the benchmarks, in their stage
    for part in cold_parts(list(cold), empty_room):
        place(part, max(stage, COLD_FIRST_STAGE))
    bench, sanitizer = tail_parts(bench_sections)
    place(sanitizer, place(bench, max(stage, TAIL_FIRST_STAGE)))
    plan.stages = dict(sorted(plan.stages.items()))
    if len(plan.stages) > MAX_STAGES:
        plan.errors.append(f"the parts need {len(plan.stages)} stages; at most {MAX_STAGES} "
                           "(two leases) are planned for: split the chunks or trim the tests")
    return plan


def gpu_test_files(root: Path = ROOT) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in (root / GPU_TESTS).glob("test_*.py"))


def make_plan(reserve: int, fixed_s: int, bench_sections: str, cache: Path | None = None,
              plan_cap: int = PLAN_STAGE_CAP) -> tuple[Plan, Collected]:
    """The plan, packed for `plan_cap` seconds a stage whatever cap a stage runs with."""
    found = collect(cache=cache)
    plan = pack(found.counts, gpu_test_files(), plan_cap - reserve - fixed_s, bench_sections,
                found.cold)
    return plan, found


def leases(plan: Plan) -> list[list[int]]:
    stages = sorted(plan.stages)
    return [stages[i:i + STAGES_PER_LEASE] for i in range(0, len(stages), STAGES_PER_LEASE)]


def over_cap(plan: Plan, stage: int, stage_cap: int, reserve: int,
             fixed: list[str]) -> tuple[int, list[str]]:
    """How many seconds a stage's minimums exceed a run cap less the reserve (0 if none),
    and the parts that then cannot have their minimums, in order: the last ones (the
    script keeps each part's minimum while the stage has it, and cuts the later parts)."""
    names = [line.split("|", 1)[0] for line in fixed] + [p.name for p in plan.stages[stage]]
    los = [_minimum(line) for line in fixed] + [p.lo for p in plan.stages[stage]]
    limit, used, cut = stage_cap - reserve, 0, []
    for name, lo in zip(names, los):
        used += lo
        if used > limit and lo:
            cut.append(name)
    return max(used - limit, 0), cut


def describe(plan: Plan, found: Collected, stage: int | None, stage_cap: int, reserve: int,
             fixed: list[str]) -> list[str]:
    """What the plan part and the dry run say beyond the parts: where the cold tests run,
    and a run cap that cannot hold a stage's minimums."""
    lines = []
    if found.cold:
        where = sorted({s for s, parts in plan.stages.items()
                        for p in parts if p.name.startswith("gpu-cold")})
        lease = {s: i for i, group in enumerate(leases(plan), 1) for s in group}
        lines.append(f"{len(found.cold)} cold tests (a timeout marker above {COLD_COMPILE_S} s: "
                     f"cold Inductor compiles, NCCL) are left out of their chunks and run in "
                     f"gpu-cold, stage {', '.join(map(str, where))} (lease "
                     f"{', '.join(str(lease[s]) for s in where)}), planned at {COLD_TEST_S} s "
                     "each; not in lease 1")
    for s in sorted(plan.stages):
        if stage is not None and s != stage:
            continue
        short, cut = over_cap(plan, s, stage_cap, reserve, fixed)
        if short:
            lines.append(f"stage {s}: its minimums are {short} s more than a {stage_cap} s cap "
                         f"allows (ACCEPT_STAGE_CAP; planned for {PLAN_STAGE_CAP} s): "
                         f"{', '.join(cut)} will be cut or not start")
    return lines


def print_dry_run(plan: Plan, found: Collected, only: int | None, stage_cap: int,
                  reserve: int, fixed: list[str]) -> None:
    total = sum(found.counts.values())
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
    for line in describe(plan, found, only, stage_cap, reserve, fixed):
        print(line)


def _minimum(part_line: str) -> int:
    return int(part_line.split("|")[1].split("-")[0].rstrip("+"))


def script_default(name: str) -> str:
    """A variable's value as gpu_acceptance.sh sets it (NAME="value" at a line's start)."""
    found = re.search(rf'^{name}="([^"]*)"', SCRIPT.read_text(), re.M)
    if not found:
        raise SystemExit(f"acceptance_plan: {SCRIPT} sets no {name}")
    return found[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", type=int)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--parts", type=Path, help="write the stage's parts here")
    # gpu_acceptance.sh exports these; the defaults are its values. The stage cap is the
    # one a stage runs with (ACCEPT_STAGE_CAP); the stages are packed for PLAN_STAGE_CAP.
    env = os.environ.get
    p.add_argument("--stage-cap", type=int,
                   default=int(env("STAGE_CAP") or env("ACCEPT_STAGE_CAP") or PLAN_STAGE_CAP))
    p.add_argument("--reserve", type=int, default=int(env("RESERVE", "5")))
    p.add_argument("--bench-sections",
                   default=env("BENCH_SECTIONS") or script_default("BENCH_SECTIONS"))
    a = p.parse_args(argv)
    # the script's own parts, before the planned ones
    a.fixed = [env("INSTALL_PART", "install|30-240|no|offline_install"),
               env("PLAN_PART", "plan|20-60|no|plan")]
    cache = None if a.dry_run else ROOT / ".cache" / "acceptance" / "collected.txt"
    plan, found = make_plan(a.reserve, sum(map(_minimum, a.fixed)), a.bench_sections, cache)
    if found.errors:
        print(f"pytest --collect-only {GPU_TESTS} reported errors (files with errors count "
              f"0 tests here and run anyway):\n{found.errors}", file=sys.stderr)
    if a.dry_run:
        print_dry_run(plan, found, a.stage, a.stage_cap, a.reserve, a.fixed)
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
        else:
            for line in describe(plan, found, a.stage, a.stage_cap, a.reserve, a.fixed):
                print(line)
    for error in plan.errors:
        print(f"acceptance_plan: {error}", file=sys.stderr)
    return 1 if plan.errors or found.errors else 0


if __name__ == "__main__":
    sys.exit(main())
