"""Train a small conv net on scikit-learn's handwritten digits with convfuse layers.

    python examples/train_digits.py [--epochs N] [--batch-size B] [--device cpu|cuda] [--graph]

The dataset (1797 8x8 images) ships inside scikit-learn, so nothing is downloaded. Without
a GPU the same layers run on convfuse's NumPy reference engine, and the script says so.
Loss and accuracy stay on the device during an epoch and are read once at its end.
"""

from __future__ import annotations

import argparse
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


def make_parser(doc: str, epochs: int, plot: str) -> argparse.ArgumentParser:
    """The command line both digits examples share."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=epochs)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="default: cuda when a GPU is usable, else cpu")
    parser.add_argument("--graph", action="store_true",
                        help="replay the training step as a CUDA graph (GPU only)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", type=Path, default=Path(plot))
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1:
        parser.error("--epochs and --batch-size must be >= 1")
    args.device = pick_device(args.device)
    args.use_graph = args.graph and args.device == "cuda"
    if args.graph and not args.use_graph:
        print("notice: --graph needs a GPU; running the step eagerly.", flush=True)
    return args


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
    args = parse(make_parser(__doc__, epochs=12, plot="digits_training.png"), argv)
    data = load_digits(args.seed)
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
