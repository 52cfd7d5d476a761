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

import math
import sys
from pathlib import Path

import convfuse as cf
from convfuse.models import ResNet
from convfuse.nn import fold_batchnorm

sys.path.insert(0, str(Path(__file__).resolve().parent))  # train_digits.py sits beside us
from train_digits import evaluate, fit, make_parser, parse


def build_model(device: str, seed: int = 0) -> ResNet:
    """(N, 1, 8, 8) -> (N, 10): a 3x3 stem and three single-block stages."""
    return ResNet((1, 1, 1), (16, 32, 64), num_classes=10, in_channels=1, stem="small",
                  device=device, seed=seed)


def main(argv: list[str] | None = None) -> float:
    args, data = parse(make_parser(__doc__, epochs=8, plot="resnet_training.png"), argv)
    model = build_model(args.device, args.seed)
    optimizer = cf.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    n_params = sum(p.size for p in model.parameters())
    print(f"convfuse {cf.__version__} on {args.device}: ResNet with {n_params} parameters, "
          f"{len(data[0])} train / {len(data[1])} test images, batch {args.batch_size}, "
          f"{args.epochs} epochs" + (", CUDA graph" if args.use_graph else ""), flush=True)

    def cosine(epoch: int) -> float:  # the last epochs settle instead of jumping around
        return args.lr * 0.5 * (1.0 + math.cos(math.pi * (epoch - 1) / args.epochs))

    accuracy = fit(model, optimizer, data, args, schedule=cosine)["test_acc"][-1]
    xp = cf.backend.xp_for(args.device)
    folded = fold_batchnorm(model)
    folded_acc = evaluate(folded, data[1], data[3], xp, 256)
    print(f"folded for inference (one fused conv per convolution, no BatchNorm): "
          f"test accuracy {folded_acc:.4f}", flush=True)
    print(f"test accuracy: {accuracy:.4f}", flush=True)
    return accuracy


if __name__ == "__main__":
    main()
