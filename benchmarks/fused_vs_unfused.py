#!/usr/bin/env python
"""Fused against unfused: layer forward, bias gradient, layer backward, training step and
Adam, with PyTorch and each case's physical floor alongside.

    python benchmarks/fused_vs_unfused.py [--quick] [--out results.json] [--plot chart.png]

Without a GPU it says so, runs the same harness on convfuse's CPU reference engine
(labelled CPU), writes the JSON and the PNG, and exits 0. See benchmarks/README.md.
Exit status: 0 when every case was measured or skipped with a reason; 1 when a case
failed or two forms disagreed (the JSON and the table say which).
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import shutil
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
if (HERE.parent / "convfuse" / "__init__.py").exists():
    # run from a checkout: measure that checkout's convfuse, not another installed one
    sys.path.insert(0, str(HERE.parent))
import bench.conv_transpose as conv_transpose  # noqa: E402
import bench.host_overhead as host_overhead  # noqa: E402
import bench.resnet as resnet  # noqa: E402
import bench.torch_compile as torch_compile  # noqa: E402
import bench.torch_convert as torch_convert  # noqa: E402
from bench import (  # noqa: E402
    adam,
    backward,
    biasgrad,
    env,
    forward,
    goals,
    peaks,
    records,
    report,
    timing,
    torch_cmp,
    train,
)
from bench.cases import CPU_CAPS, LAYOUTS, PRECISIONS  # noqa: E402
from bench.engine import Engine, make_engine  # noqa: E402
from bench.plot import save as save_plot  # noqa: E402
from bench.records import Context  # noqa: E402
from bench.timing import Budget  # noqa: E402

import convfuse as cf  # noqa: E402

SECTIONS = {"forward": forward.run, "backward": backward.run, "biasgrad": biasgrad.run,
            "train": train.run, "adam": adam.run, "goals": goals.run,
            "host-overhead": host_overhead.run,
            "compile": torch_compile.run}
# Sections run only when named in --sections: `compile` compiles ResNet-18 three ways
# (minutes of Inductor's C++ on a CPU).
OPT_IN = ("compile",)
RESULTS_DIR = HERE / "results"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="fewer cases and repetitions (GPU) / small shapes (CPU)")
    p.add_argument("--out", type=Path, default=Path("fused_vs_unfused.json"),
                   help="JSON file with every raw number and the environment")
    p.add_argument("--plot", type=Path, default=Path("fused_vs_unfused.png"),
                   help="PNG bar chart of the ratios")
    p.add_argument("--sections", default=",".join(n for n in SECTIONS if n not in OPT_IN),
                   help=f"comma-separated subset of {','.join(SECTIONS)} ({', '.join(OPT_IN)} "
                        "only when named)")
    p.add_argument("--precisions", default=",".join(PRECISIONS),
                   help=f"comma-separated subset of {','.join(PRECISIONS)}")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="NCHW,NHWC or one of them")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch columns")
    p.add_argument("--torch-convert", action="store_true",
                   help="also time a torch.nn conv net against convfuse.torch.convert of it")
    p.add_argument("--resnet", action="store_true",
                   help="also time ResNet-18 training steps: convfuse eager and captured "
                        "against PyTorch eager (cudnn.benchmark, channels_last, AMP on GPUs)")
    p.add_argument("--no-conv-transpose", action="store_true",
                   help="skip the ConvTranspose section (U-Net decoder layers: fused, unfused "
                        "and PyTorch, forward and backward)")
    p.add_argument("--heuristics", action="store_true",
                   help="choose convfuse's algorithms by heuristics instead of autotuning "
                        "(PyTorch always runs with cudnn.benchmark=True)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-result", action="store_true",
                   help="GPU only: also keep the JSON in benchmarks/results/, named after "
                        "the device")
    p.add_argument("--from-json", type=Path, default=None,
                   help="measure nothing: print the tables and draw --plot from a saved JSON")
    p.add_argument("--quiet", action="store_true", help="no per-case progress on stderr")
    p.add_argument("--stream", type=Path, default=None,
                   help="append one JSON line per section as it finishes (with the "
                        "environment), so a run cut short keeps every finished section")
    args = p.parse_args(argv)
    args.sections = _subset(p, "--sections", args.sections, SECTIONS)
    args.precisions = _subset(p, "--precisions", args.precisions, PRECISIONS)
    args.layouts = _subset(p, "--layouts", args.layouts.upper(), LAYOUTS)
    return args


def _subset(p: argparse.ArgumentParser, flag: str, text: str, known) -> tuple[str, ...]:
    items = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [s for s in items if s not in known]
    if unknown or not items:
        p.error(f"{flag}: unknown or empty {unknown or text!r}; choose from {', '.join(known)}")
    return items


def budget_for(engine: Engine, quick: bool) -> Budget:
    if engine.is_gpu:  # pragma: gpu
        return Budget(5, 10, 100, 0.2) if quick else Budget(10, 30, 1000, 1.0)
    # interleaved rounds go on until the medians are pinned down or `seconds` run out
    return Budget(1, 5, 60, 0.25) if quick else Budget(2, 7, 200, 2.0)


def result_name(device_name: str, when: datetime.datetime) -> str:
    """A results/ file stem that names the device: 'nvidia-h100-80gb-hbm3-20261121-2130'."""
    device = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    return f"{device}-{when:%Y%m%d-%H%M}"


def measure_all(args: argparse.Namespace, argv: list[str]) -> dict:
    """Run the chosen sections; return the JSON payload (raw numbers and environment)."""
    engine, notice = make_engine(None if args.device == "auto" else args.device)
    log = (lambda msg: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr,
                                                                    flush=True))
    print(f"convfuse {cf.__version__} fused-vs-unfused benchmark on {engine.label}"
          + (" (--quick)" if args.quick else ""), flush=True)
    if notice:
        print(notice, flush=True)
    with cf.config.flags(benchmark=engine.is_gpu and not args.heuristics):
        floors = (set(args.sections) - {"host-overhead"} or args.torch_convert
                  or args.resnet or not args.no_conv_transpose)
        used_peaks, peaks_info = peaks.resolve(engine, args.quick, measure=bool(floors))
        torch_side, torch_note = torch_cmp.load(engine, args.no_torch,
                                                autotune=not args.heuristics)
        ctx = Context(engine, used_peaks, args.quick, budget_for(engine, args.quick), args.seed,
                      log, torch_side, torch_note, args.precisions, args.layouts)
        print(f"peaks for the floors: {used_peaks.source}", flush=True)
        print(f"PyTorch: {torch_note or torch_side.label}", flush=True)
        results: dict[str, list] = {}
        extras: dict[str, Any] = {"torch_convert": None, "resnet": None, "conv_transpose": None}
        chosen = [n for n in SECTIONS if n in args.sections]
        wanted = {"torch_convert": (args.torch_convert, lambda: torch_convert.run(args.quick)),
                  "resnet": (args.resnet, lambda: resnet.run(args.quick)),
                  "conv_transpose": (not args.no_conv_transpose,
                                     lambda: conv_transpose.run(args.quick))}
        # `compile` (cold Inductor compiles: minutes on a GPU) runs after the opt-in extras,
        # so that a time cap there cuts nothing else; the extras run under the same
        # autotuning flag as the sections (PyTorch's forms autotune too). A time cap's
        # interrupt ends the run, but the payload of what it measured is built and written
        # all the same (_main re-raises the interrupt after that).
        cut, current = False, None
        try:
            for name in [n for n in chosen if n != "compile"]:
                current = name
                results[name] = _section(args, name, ctx, argv, torch_note)
            current = None
            for name, (on, run) in wanted.items():
                if on:
                    extras[name] = _streamed(args, name, engine, argv, torch_note, run,
                                             torch_side)
            for name in [n for n in chosen if n == "compile"]:
                current = name
                results[name] = _section(args, name, ctx, argv, torch_note)
        except KeyboardInterrupt:
            cut = True
            if current is not None and current not in results:  # its finished cases
                results[current] = list(ctx.finished)
    return {
        "cut": cut,
        "schema": 1,
        "engine": engine.kind,
        "label": engine.label,
        "device_name": engine.info.get("name"),
        "notice": notice,
        "environment": env.collect(engine, argv, torch_note),
        "peaks": peaks_info,
        "method": {
            "budget": vars(ctx.budget),
            "timer": engine.timer.kind,
            "statistic": "median of the repetitions, with min and max; ratios of medians",
            "interleaved": "compared forms are timed one call each per round, the order "
                           "rotating; rounds continue until every median's ~95% interval "
                           f"is within {timing.TARGET_SPREAD:.0%} of it or the budget ends",
            "spread": "relative width of a distribution-free ~95% interval of the median "
                      "(order statistics n/2 -+ 0.98 sqrt(n)); a ratio's interval is "
                      "[lo_a/hi_b, hi_a/lo_b]",
            "unstable_threshold": {"time": timing.UNSTABLE_SPREAD,
                                   "ratio": timing.UNSTABLE_RATIO_SPREAD},
            "cpu_shape_caps": None if engine.is_gpu else dict(zip(
                ("batch", "spatial", "channels"), CPU_CAPS[args.quick])),
            "cache_bytes_for_rotation": engine.cache_bytes,
            "convfuse_autotune": engine.is_gpu and not args.heuristics,
            "torch_cudnn_benchmark": engine.is_gpu and not args.heuristics
            and torch_side is not None,
            "seed": args.seed,
            "quick": args.quick,
            "sections": list(args.sections),
            "precisions": list(args.precisions),
            "layouts": list(args.layouts),
        },
        "forms": {k: report.FORMS[engine.kind][k] for k in results},
        "bias_grad_recommendation": (biasgrad.recommendation(results["biasgrad"], engine.is_gpu)
                                     if "biasgrad" in results else None),
        "counts": _with_extra_errors(report.counts(results), extras),
        "results": results,
        "torch_convert": extras["torch_convert"],
        "resnet": extras["resnet"],
        "forward_paths": _forward_paths(),
        "conv_transpose": extras["conv_transpose"],
    }


def _section(args: argparse.Namespace, name: str, ctx: Context, argv: list[str],
             torch_note: str) -> list:
    """Run one section and stream it; a time cap's interrupt (SIGINT, or SIGTERM: main)
    streams the records it finished, marked cut, and ends the run."""
    ctx.finished, ctx.interrupted = [], False
    if ctx.torch is not None:
        ctx.torch.match_convfuse_tf32()
    try:
        result = SECTIONS[name](ctx)
    except Exception as exc:  # outside any case (which records.guarded keeps): one record
        result = [*ctx.finished, records.fail(records.new(name, "(section)"), exc)]
        ctx.log(f"{name}: error outside a case: {type(exc).__name__}: {exc}")
    except KeyboardInterrupt:
        if args.stream:
            stream_section(args.stream, name, list(ctx.finished), ctx.engine, argv,
                           torch_note, cut=True)
        raise
    if args.stream:
        stream_section(args.stream, name, result, ctx.engine, argv, torch_note,
                       cut=ctx.interrupted)
    if ctx.interrupted:  # the section kept what it measured; the run ends all the same
        raise KeyboardInterrupt
    return result


def stream_section(path: Path, name: str, result, engine: Engine, argv: list[str],
                   torch_note: str, cut: bool = False) -> None:
    """One JSON line for a section: its results, counts and the environment (the device,
    driver and versions), appended and flushed at once; `cut`: a time cap ended it, and
    the results are the cases it finished."""
    try:
        counts = report.counts({name: result})
    except (AttributeError, KeyError, TypeError):  # resnet, torch_convert: no case records
        counts = {}
    line = {"section": name, "environment": env.collect(engine, argv, torch_note),
            "counts": counts, "results": result}
    if cut:
        line["cut"] = True
    with path.open("a") as f:
        f.write(json.dumps(line, default=str) + "\n")
        f.flush()


def _streamed(args: argparse.Namespace, name: str, engine: Engine, argv: list[str],
              torch_note: str, run, torch_side: Any = None):
    """An extra's result, streamed; one that raises gives {"error": ...} (counted as an
    error, printed in its place) and the run goes on."""
    if torch_side is not None:  # as _section does
        torch_side.match_convfuse_tf32()
    try:
        result = run()
    except Exception as exc:
        result = {"error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exception(type(exc), exc,
                                                          exc.__traceback__)[-6:]}
        print(f"{name}: error: {result['error']}", file=sys.stderr, flush=True)
    if args.stream:
        stream_section(args.stream, name, result, engine, argv, torch_note)
    return result


def _with_extra_errors(counts: dict[str, int], extras: dict[str, Any]) -> dict[str, int]:
    """The sections' counts, with one error per extra that raised."""
    failed = sum(1 for v in extras.values() if isinstance(v, dict) and "error" in v)
    return {**counts, "error": counts.get("error", 0) + failed}


def _forward_paths() -> list[dict]:
    """How each conv plan ran conv + bias + activation (fused or unfused, and why)."""
    from dataclasses import asdict

    from convfuse.plan import forward_paths

    return [{"plan": desc, **asdict(path)} for desc, path in forward_paths()]


def render(payload: dict, args: argparse.Namespace) -> None:
    """The tables on stdout and the PNG, from a payload (just measured, or loaded)."""
    on_gpu = payload["engine"] == "gpu"
    footer = []
    if payload["bias_grad_recommendation"]:
        footer.append(f"bias gradient: {payload['bias_grad_recommendation']['text']}")
    footer.append("cases: " + ", ".join(f"{n} {k}" for k, n in payload["counts"].items()))
    footer.append(f"JSON: {args.from_json or args.out}   chart: {args.plot}")
    if not on_gpu:
        footer.append("CPU run: no GPU numbers were measured; nothing here is a GPU result. "
                      "Floors use measured CPU copy and GEMM rates, so a roofline above 100% "
                      "means a case beat those measurements (e.g. from cache), not physics.")
    report.print_report(payload["results"], payload["engine"], footer)
    for name, fmt in (("torch_convert", torch_convert.format_table), ("resnet", resnet.table),
                      ("conv_transpose", conv_transpose.format_table)):
        extra = payload.get(name)
        if isinstance(extra, dict) and "error" in extra:
            print(f"\n{name}: error: {extra['error']}")
        elif extra:
            print(fmt(extra))
    if payload.get("cut"):
        print("\nCUT: a time cap ended this run; the tables hold what it finished")
    paths = payload.get("forward_paths") or []
    if paths:
        print("\nfused forward paths (convfuse.plan.forward_paths()):")
        for row in paths:
            times = "" if row.get("fused_ms") is None else (
                f"  fused {row['fused_ms']:.3f} ms, unfused {row['unfused_ms']:.3f} ms")
            print(f"  {row['path']:8s} ({row['reason']}) {row['plan']}{times}")
    title = f"convfuse: ratios of median times on {payload['label']}"
    if not on_gpu:
        caps = payload["method"].get("cpu_shape_caps") or {}
        title += ("\nCPU reference engine vs PyTorch CPU: says nothing about GPU performance"
                  f"\nCPU layer shapes scaled down to batch <= {caps.get('batch')}, spatial "
                  f"<= {caps.get('spatial')}, channels <= {caps.get('channels')} (the goals "
                  "panel runs full size)")
    save_plot(args.plot, payload["results"], title, payload["engine"])


def keep_result(payload: dict, args: argparse.Namespace) -> None:
    if payload["engine"] != "gpu":
        print("--save-result: not saved; benchmarks/results/ keeps GPU runs only")
        return
    stem = result_name(payload["device_name"], datetime.datetime.now())  # pragma: gpu
    shutil.copyfile(args.out, RESULTS_DIR / f"{stem}.json")  # pragma: gpu
    print(f"kept in {RESULTS_DIR / stem}.json (chart: --from-json it with --plot)")  # pragma: gpu


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    # timeout(1)'s SIGTERM ends the run as a SIGINT does: the sections stream what they
    # finished (_section) instead of the process dying with nothing written
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if main_thread else None
    try:
        return _main(args, argv)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def _main(args: argparse.Namespace, argv: list[str]) -> int:
    if args.from_json:
        payload = json.loads(args.from_json.read_text())
        print(f"from {args.from_json}: {payload['label']}, "
              f"{payload['environment']['timestamp_utc']}")
    else:
        payload = measure_all(args, argv)
        report.write_json(args.out, payload)
    render(payload, args)
    if payload.get("cut") and not args.from_json:  # written and shown; the run still ends
        # as the cap ended it
        raise KeyboardInterrupt("a time cap ended the run")
    if args.save_result and not args.from_json:
        keep_result(payload, args)
    counts = payload["counts"]
    return 1 if counts.get("error") or counts.get("check_failed") else 0


if __name__ == "__main__":
    sys.exit(main())
