"""Train a small conv net on scikit-learn's handwritten digits with convfuse layers.

    python examples/train_digits.py [--epochs N] [--batch-size B] [--device cpu|cuda] [--graph]

The dataset (1797 8x8 images) ships inside scikit-learn, so nothing is downloaded. Without
a GPU the same layers run on convfuse's NumPy reference engine, and the script says so.
Loss and accuracy stay on the device during an epoch and are read once at its end.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import convfuse as cf
from convfuse.selfcheck import gpu_unusable_reason


def build_model(device: str, seed: int = 0) -> cf.Sequential:
    """conv-relu-pool twice, then linear: (N, 1, 8, 8) -> (N, 10)."""
    model = cf.Sequential(
        cf.Conv2d(1, 16, 3, padding=1, activation="relu", device=device, seed=seed),
        cf.MaxPool2d(2),
        cf.Conv2d(16, 32, 3, padding=1, activation="relu", device=device, seed=seed + 1),
        cf.MaxPool2d(2),
        cf.Flatten(),
        cf.Linear(32 * 2 * 2, 10, device=device, seed=seed + 2),
    ).to(device)
    model.needs_input_grad = False  # the images need no gradient: skip the first layer's dx
    return model


def load_digits(seed: int = 0, test_fraction: float = 0.2):
    """Images scaled to [0, 1] as (N, 1, 8, 8) float32, labels int32; a stratified split."""
    from sklearn.datasets import load_digits as sk_load_digits
    from sklearn.model_selection import train_test_split

    data = sk_load_digits()
    x = (data.images / 16.0).astype(np.float32)[:, None, :, :]
    y = data.target.astype(np.int32)
    return train_test_split(x, y, test_size=test_fraction, random_state=seed, stratify=y)


def pick_device(requested: str | None) -> str:
    if requested == "cpu":
        return "cpu"
    reason = gpu_unusable_reason()  # a GPU, and an install convfuse's GPU path can use
    if reason is None:
        return "cuda"
    if requested == "cuda":
        sys.exit(f"--device cuda: {reason}")
    print(f"notice: {reason}; falling back to the CPU reference engine (NumPy).", flush=True)
    return "cpu"


def progress(epoch: int, epochs: int, done: int, total: int, width: int = 30,
             stream: Any = None) -> None:
    """A live bar on a terminal; on anything else (a log file, a pipe) one line per epoch,
    written when the epoch ends, so logs hold no carriage-return segments."""
    stream = sys.stderr if stream is None else stream
    filled = width * done // total
    bar = "#" * filled + "-" * (width - filled)
    line = f"epoch {epoch:>2}/{epochs} [{bar}] {done}/{total}"
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        end = "\n" if done == total else ""
        print(f"\r{line}", end=end, file=stream, flush=True)
    elif done == total:
        print(line, file=stream, flush=True)


def make_step(model, loss_fn, optimizer, loss_mean, correct_mean):
    """One training step on one batch; everything stays on the device (capturable)."""

    def step(xb, yb):
        optimizer.zero_grad()
        logits = model(xb)
        loss = loss_fn(logits, yb)
        model.backward(loss_fn.backward())
        optimizer.step()
        loss_mean.add(loss)
        correct_mean.add(loss_fn.correct, count=xb.shape[0])
        return loss

    return step


@cf.no_grad()  # no backward follows: the layers keep nothing for one
def evaluate(model, x, y, xp, batch_size: int) -> float:
    correct = 0
    for i in range(0, len(x), batch_size):
        logits = model(xp.asarray(x[i:i + batch_size]))
        pred = logits.argmax(axis=1)
        correct += int((pred == xp.asarray(y[i:i + batch_size])).sum())
    return correct / len(x)


def save_plot(history: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = range(1, len(history["loss"]) + 1)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    ax1.plot(epochs, history["loss"], marker="o")
    ax1.set(title="training loss", xlabel="epoch", ylabel="cross-entropy")
    ax2.plot(epochs, history["train_acc"], marker="o", label="train")
    ax2.plot(epochs, history["test_acc"], marker="s", label="test")
    ax2.set(title="accuracy", xlabel="epoch", ylim=(0, 1.01))
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- the command line: every option is checked before any training -----------------------
# (train_resnet.py, train_unet.py and train_ddp.py use these too)
MAX_SEED = 2**32 - 1  # scikit-learn's train_test_split takes random_state up to this


def positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type: `kind(text)`, refused unless finite and > 0 (so >= 1 for int)."""

    def check(text: str) -> Any:
        value = kind(text)
        if not (math.isfinite(value) and value > 0):
            finite = " and finite" if kind is float else ""
            raise argparse.ArgumentTypeError(f"must be positive{finite}, got {text}")
        return value

    check.__name__ = kind.__name__  # argparse names the type in "invalid int value: ..."
    return check


def seed_int(text: str) -> int:
    """An argparse type: a seed from 0 to MAX_SEED."""
    value = int(text)
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be from 0 to {MAX_SEED}, got {text}")
    return value


seed_int.__name__ = "int"  # argparse: "invalid int value: ..."


def check_output_file(parser: argparse.ArgumentParser, option: str, path: Path) -> None:
    """Refuse, before training, a --plot path that savefig would fail on after it: a missing
    or unwritable directory (savefig does not create one), a directory given as the file, or
    a suffix matplotlib cannot write."""
    where = f"{option} {path}"
    if path.is_dir():
        parser.error(f"{where}: is a directory; give a file name such as {path / 'curves.png'}")
    parent = path.parent
    if not parent.is_dir():
        parser.error(f"{where}: directory {parent} does not exist (create it first)")
    if not os.access(parent, os.W_OK):
        parser.error(f"{where}: directory {parent} is not writable")
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        parser.error(f"{option} needs matplotlib: pip install matplotlib")
    # pgf is listed, but writing it needs a LaTeX install (xelatex): after training, the
    # curves would be lost to a RuntimeError
    formats = {k: v for k, v in FigureCanvasBase.get_supported_filetypes().items()
               if k != "pgf"}
    if path.suffix[1:].lower() not in formats:
        parser.error(f"{where}: matplotlib cannot write {path.suffix or 'a file with no suffix'}"
                     f"; use one of {', '.join('.' + f for f in sorted(formats))}")


def check_batch_size(parser: argparse.ArgumentParser, batch_size: int, train_size: int,
                     world: int = 1) -> None:
    """An epoch trains on full batches only (a CUDA graph replays static shapes; the
    remainder is dropped, as DataLoader(drop_last=True) does), so a batch larger than the
    training set would train on nothing: refuse it. With `world` ranks the global batch
    splits evenly over them."""
    if batch_size % world:
        parser.error(f"--batch-size {batch_size} must be divisible by the world size {world}")
    if batch_size > train_size:
        parser.error(f"--batch-size {batch_size} is larger than the {train_size} training "
                     f"images (epochs use full batches only); use at most {train_size}")


def make_parser(doc: str, epochs: int, plot: str) -> argparse.ArgumentParser:
    """The command line both digits examples share."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--epochs", type=positive(int), default=epochs)
    parser.add_argument("--batch-size", type=positive(int), default=32)
    parser.add_argument("--lr", type=positive(float), default=3e-3)
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="default: cuda when a GPU is usable, else cpu")
    parser.add_argument("--graph", action="store_true",
                        help="replay the training step as a CUDA graph (GPU only)")
    parser.add_argument("--seed", type=seed_int, default=0)
    parser.add_argument("--plot", type=Path, default=Path(plot),
                        help="where to save the training curves (its directory must exist)")
    return parser


def parse(parser: argparse.ArgumentParser,
          argv: list[str] | None) -> tuple[argparse.Namespace, tuple]:
    """The checked command line and the data (the batch size is checked against it); the
    device is picked last, once every option has passed."""
    args = parser.parse_args(argv)
    check_output_file(parser, "--plot", args.plot)
    data = load_digits(args.seed)
    check_batch_size(parser, args.batch_size, len(data[0]))
    args.device = pick_device(args.device)
    args.use_graph = args.graph and args.device == "cuda"
    if args.graph and not args.use_graph:
        print("notice: --graph needs a GPU; running the step eagerly.", flush=True)
    return args, data


def fit(model: Any, optimizer: Any, data: tuple, args: argparse.Namespace,
        schedule: Callable[[int], float] | None = None) -> dict[str, list[float]]:
    """Train for args.epochs; the model is in train mode for steps and eval mode for the
    test pass (BatchNorm). `schedule(epoch)`, when given, sets the learning rate per epoch:
    setting .lr fills the optimizer's device scalar, so a captured step sees it too."""
    x_train, x_test, y_train, y_test = data
    xp = cf.backend.xp_for(args.device)
    loss_fn = cf.CrossEntropyLoss()
    loss_mean, correct_mean = cf.metrics.Mean(), cf.metrics.Mean()
    step = make_step(model, loss_fn, optimizer, loss_mean, correct_mean)
    rng = np.random.default_rng(args.seed)
    batches = len(x_train) // args.batch_size  # full batches only: a graph has static shapes
    history: dict[str, list[float]] = {"loss": [], "train_acc": [], "test_acc": []}
    captured = None
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        order = rng.permutation(len(x_train))
        loss_mean.reset()
        correct_mean.reset()
        model.train()
        if schedule is not None:
            optimizer.lr = schedule(epoch)
        for b in range(batches):
            idx = order[b * args.batch_size:(b + 1) * args.batch_size]
            xb, yb = xp.asarray(x_train[idx]), xp.asarray(y_train[idx])
            if args.use_graph:
                if captured is None:
                    captured = cf.graph.capture(step, xb, yb)  # its warm-up is this batch's step
                else:
                    captured(xb, yb)
            else:
                step(xb, yb)
            progress(epoch, args.epochs, b + 1, batches)
        history["loss"].append(loss_mean.compute())
        history["train_acc"].append(correct_mean.compute())
        model.eval()
        history["test_acc"].append(evaluate(model, x_test, y_test, xp, 256))
        print(f"epoch {epoch:>2}: loss {history['loss'][-1]:.4f}  "
              f"train acc {history['train_acc'][-1]:.4f}  "
              f"test acc {history['test_acc'][-1]:.4f}", flush=True)
    elapsed = time.perf_counter() - start
    save_plot(history, args.plot)
    print(f"trained in {elapsed:.1f} s; curves saved to {args.plot}", flush=True)
    return history


def main(argv: list[str] | None = None) -> float:
    args, data = parse(make_parser(__doc__, epochs=12, plot="digits_training.png"), argv)
    model = build_model(args.device, args.seed)
    optimizer = cf.optim.Adam(model.parameters(), lr=args.lr)
    print(f"convfuse {cf.__version__} on {args.device}: {len(data[0])} train / "
          f"{len(data[1])} test images, batch {args.batch_size}, {args.epochs} epochs"
          + (", CUDA graph" if args.use_graph else ""), flush=True)
    accuracy = fit(model, optimizer, data, args)["test_acc"][-1]
    print(f"test accuracy: {accuracy:.4f}", flush=True)
    return accuracy


if __name__ == "__main__":
    main()
