"""Train a small ResNet (BatchNorm, residual blocks) on scikit-learn's digits with convfuse.

    python examples/train_resnet.py [--epochs N] [--batch-size B] [--device cpu|cuda] [--graph]

Three stages of one BasicBlock each (16, 32, 64 channels; 8x8 -> 4x4 -> 2x2) after a 3x3
stem, then a global average pool and a linear layer: torchvision's ResNet design at the
digits' scale. Every BatchNorm applies its ReLU itself and each block's second BatchNorm
also adds the shortcut, so the net has no separate elementwise pass. AdamW with a cosine
learning-rate decay per epoch. After training, the
model is folded for inference (convfuse.nn.fold_batchnorm: each conv + BatchNorm becomes one
fused convolution) and evaluated again. Without a GPU it runs on the NumPy reference engine
and says so. Data loading, the progress bar and the plot come from train_digits.py.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

import convfuse as cf
from convfuse.models import ResNet
from convfuse.nn import fold_batchnorm

sys.path.insert(0, str(Path(__file__).resolve().parent))  # train_digits.py sits beside us
from train_digits import evaluate, load_digits, make_step, pick_device, progress, save_plot


def build_model(device: str, seed: int = 0) -> ResNet:
    """(N, 1, 8, 8) -> (N, 10): a 3x3 stem and three single-block stages."""
    return ResNet((1, 1, 1), (16, 32, 64), num_classes=10, in_channels=1, stem="small",
                  device=device, seed=seed)


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="default: cuda when a GPU is usable, else cpu")
    parser.add_argument("--graph", action="store_true",
                        help="replay the training step as a CUDA graph (GPU only)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", type=Path, default=Path("resnet_training.png"))
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1:
        parser.error("--epochs and --batch-size must be >= 1")

    device = pick_device(args.device)
    use_graph = args.graph and device == "cuda"
    if args.graph and not use_graph:
        print("notice: --graph needs a GPU; running the step eagerly.", flush=True)
    xp = cf.backend.xp_for(device)

    x_train, x_test, y_train, y_test = load_digits(args.seed)
    model = build_model(device, args.seed)
    loss_fn = cf.CrossEntropyLoss()
    optimizer = cf.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    loss_mean, correct_mean = cf.metrics.Mean(), cf.metrics.Mean()
    step = make_step(model, loss_fn, optimizer, loss_mean, correct_mean)
    n_params = sum(p.size for p in model.parameters())
    print(f"convfuse {cf.__version__} on {device}: ResNet with {n_params} parameters, "
          f"{len(x_train)} train / {len(x_test)} test images, batch {args.batch_size}, "
          f"{args.epochs} epochs" + (", CUDA graph" if use_graph else ""), flush=True)

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
        # Cosine decay per epoch: the last epochs settle instead of jumping around. Setting
        # .lr fills the optimizer's device scalar, so a captured step sees it too.
        optimizer.lr = args.lr * 0.5 * (1.0 + math.cos(math.pi * (epoch - 1) / args.epochs))
        for b in range(batches):
            idx = order[b * args.batch_size:(b + 1) * args.batch_size]
            xb, yb = xp.asarray(x_train[idx]), xp.asarray(y_train[idx])
            if use_graph:
                if captured is None:
                    captured = cf.graph.capture(step, xb, yb)  # its warm-up is this batch's step
                else:
                    captured(xb, yb)
            else:
                step(xb, yb)
            progress(epoch, args.epochs, b + 1, batches)
        history["loss"].append(loss_mean.compute())
        history["train_acc"].append(correct_mean.compute())
        model.eval()  # BatchNorm uses its running statistics
        history["test_acc"].append(evaluate(model, x_test, y_test, xp, 256))
        print(f"epoch {epoch:>2}: loss {history['loss'][-1]:.4f}  "
              f"train acc {history['train_acc'][-1]:.4f}  "
              f"test acc {history['test_acc'][-1]:.4f}", flush=True)

    elapsed = time.perf_counter() - start
    save_plot(history, args.plot)
    print(f"trained in {elapsed:.1f} s; curves saved to {args.plot}", flush=True)
    folded = fold_batchnorm(model)
    folded_acc = evaluate(folded, x_test, y_test, xp, 256)
    print(f"folded for inference (one fused conv per convolution, no BatchNorm): "
          f"test accuracy {folded_acc:.4f}", flush=True)
    accuracy = history["test_acc"][-1]
    print(f"test accuracy: {accuracy:.4f}", flush=True)
    return accuracy


if __name__ == "__main__":
    main()
