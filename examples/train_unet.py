"""Train a small U-Net to denoise scikit-learn's handwritten digits with convfuse layers.

    python examples/train_unet.py [--epochs N] [--batch-size B] [--noise S] [--device cpu|cuda]
    python examples/train_unet.py --torch     # the same net in torch.nn, through convert()

Encoder: Conv + BatchNorm(ReLU) then max-pool, twice; decoder: ConvTranspose2d(stride 2,
ReLU) up-sampling. The skip connections ride on the decoder's transposed convolutions:
`up(x, residual=skip)` computes relu(conv_transpose(x) + bias + skip) in one fused op
(convfuse layers); the --torch model concatenates instead (torch.cat, as most U-Nets do),
and convert() folds each ConvTranspose2d -> ReLU pair into one convfuse layer.

The task: images scaled to [0, 1], plus Gaussian noise (sigma 0.3 by default); the net
predicts the clean image. The metric is the test set's PSNR gain in dB: PSNR(denoised,
clean) - PSNR(noisy, clean). Without a GPU the layers run on the NumPy reference engine.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import convfuse as cf

sys.path.insert(0, str(Path(__file__).resolve().parent))  # train_digits.py sits beside us
from train_digits import check_batch_size, pick_device, positive, seed_int


class UNet(cf.Module):
    """(N, 1, 8, 8) -> (N, 1, 8, 8); two levels, skips through residual=."""

    def __init__(self, device: str, width: int = 16, seed: int = 0) -> None:
        w = width
        kw: dict[str, Any] = {"device": device}
        self.enc1 = cf.Sequential(cf.Conv2d(1, w, 3, padding=1, bias=False, seed=seed, **kw),
                                  cf.BatchNorm2d(w, activation="relu", **kw))
        self.pool1 = cf.MaxPool2d(2)
        self.enc2 = cf.Sequential(
            cf.Conv2d(w, 2 * w, 3, padding=1, bias=False, seed=seed + 1, **kw),
            cf.BatchNorm2d(2 * w, activation="relu", **kw))
        self.pool2 = cf.MaxPool2d(2)
        self.mid = cf.Sequential(
            cf.Conv2d(2 * w, 4 * w, 3, padding=1, bias=False, seed=seed + 2, **kw),
            cf.BatchNorm2d(4 * w, activation="relu", **kw))
        self.up2 = cf.ConvTranspose2d(4 * w, 2 * w, 2, 2, activation="relu", seed=seed + 3, **kw)
        self.dec2 = cf.Sequential(
            cf.Conv2d(2 * w, 2 * w, 3, padding=1, bias=False, seed=seed + 4, **kw),
            cf.BatchNorm2d(2 * w, activation="relu", **kw))
        self.up1 = cf.ConvTranspose2d(2 * w, w, 2, 2, activation="relu", seed=seed + 5, **kw)
        self.out = cf.Conv2d(w, 1, 3, padding=1, seed=seed + 6, **kw)
        self.enc1.needs_input_grad = False  # the images need no gradient

    def forward(self, x: Any) -> Any:
        e1 = self.enc1(x)
        e2 = self.enc2(self.pool1(e1))
        m = self.mid(self.pool2(e2))
        d2 = self.dec2(self.up2(m, residual=e2))    # relu(up(m) + b + e2), one fused op
        return self.out(self.up1(d2, residual=e1))

    def backward(self, dy: Any) -> None:
        d_u1, d_e1 = self.up1.backward(self.out.backward(dy))
        d_u2, d_e2 = self.up2.backward(self.dec2.backward(d_u1))
        d_e2 = d_e2 + self.pool2.backward(self.mid.backward(d_u2))
        d_e1 = d_e1 + self.pool1.backward(self.enc2.backward(d_e2))
        self.enc1.backward(d_e1)


def torch_unet(width: int = 16) -> Any:
    """The same net in torch.nn, with concatenated skips."""
    import torch
    from torch import nn

    w = width

    def block(cin: int, cout: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                             nn.BatchNorm2d(cout), nn.ReLU())

    class TorchUNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc1, self.enc2, self.mid = block(1, w), block(w, 2 * w), block(2 * w, 4 * w)
            self.pool = nn.MaxPool2d(2)
            self.up2 = nn.Sequential(nn.ConvTranspose2d(4 * w, 2 * w, 2, 2), nn.ReLU())
            self.dec2 = block(4 * w, 2 * w)
            self.up1 = nn.Sequential(nn.ConvTranspose2d(2 * w, w, 2, 2), nn.ReLU())
            self.out = nn.Conv2d(2 * w, 1, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            e1 = self.enc1(x)
            e2 = self.enc2(self.pool(e1))
            m = self.mid(self.pool(e2))
            d2 = self.dec2(torch.cat([self.up2(m), e2], dim=1))
            return self.out(torch.cat([self.up1(d2), e1], dim=1))

    return TorchUNet()


def load_data(noise: float, seed: int = 0) -> tuple[np.ndarray, ...]:
    """(noisy train, clean train, noisy test, clean test), (N, 1, 8, 8) float32 in [0, 1]."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    images = (load_digits().images / 16.0).astype(np.float32)[:, None]
    train, test = train_test_split(images, test_size=0.2, random_state=seed)
    rng = np.random.default_rng(seed)
    noisy = [(a + noise * rng.standard_normal(a.shape)).astype(np.float32)
             for a in (train, test)]
    return noisy[0], train, noisy[1], test


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio in dB for images in [0, 1] (a clipped to that range)."""
    mse = float(np.mean((np.clip(a, 0.0, 1.0) - b) ** 2))
    return 10.0 * math.log10(1.0 / mse)


def train_convfuse(data: tuple[np.ndarray, ...], args: argparse.Namespace) -> np.ndarray:
    device = pick_device(args.device)
    xp = cf.backend.xp_for(device)
    x_tr, y_tr, x_te, _ = data
    model = UNet(device, seed=args.seed)
    opt = cf.optim.Adam(model.parameters(), lr=args.lr)
    rng = np.random.default_rng(args.seed)
    for epoch in range(1, args.epochs + 1):
        model.train()
        order = rng.permutation(len(x_tr))
        mse = cf.metrics.Mean()  # summed where the values live: no host read per step
        for i in range(0, len(order) - args.batch_size + 1, args.batch_size):
            idx = order[i:i + args.batch_size]
            x, t = xp.asarray(x_tr[idx]), xp.asarray(y_tr[idx])
            opt.zero_grad()
            diff = model(x) - t
            model.backward(2.0 * diff / diff.size)  # d mean((y - t)^2) / dy
            opt.step()
            mse.add((diff * diff).mean())
        print(f"epoch {epoch:2d}: train mse {mse.compute():.5f}", flush=True)
    model.eval()
    with cf.no_grad():  # as torch.no_grad below: nothing kept for a backward
        out = model(xp.asarray(x_te))
    return cf.backend.to_device(out, "cpu") if device == "cuda" else out


def train_torch(data: tuple[np.ndarray, ...], args: argparse.Namespace) -> np.ndarray:
    import torch

    from convfuse.torch import ConvTranspose2d, convert

    torch.manual_seed(args.seed)
    device = "cuda" if pick_device(args.device) == "cuda" else "cpu"
    if device == "cpu":
        # 8x8 images: torch's CPU kernels (pooling, Adam) spend more on waking threads
        # than on the work, and spin against other processes on a busy machine.
        torch.set_num_threads(1)
    model = convert(torch_unet()).to(device)
    assert isinstance(model.up1[0], ConvTranspose2d) and model.up1[0].activation == "relu"
    x_tr, y_tr, x_te, _ = (torch.from_numpy(a).to(device) for a in data)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed)
    for epoch in range(1, args.epochs + 1):
        model.train()
        order = torch.randperm(len(x_tr), generator=gen)
        total, steps = 0.0, 0
        for i in range(0, len(order) - args.batch_size + 1, args.batch_size):
            idx = order[i:i + args.batch_size].to(device)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x_tr[idx]), y_tr[idx])
            loss.backward()
            opt.step()
            total, steps = total + loss.item(), steps + 1
        print(f"epoch {epoch:2d}: train mse {total / steps:.5f}", flush=True)
    model.eval()
    with torch.no_grad():
        return model(x_te).cpu().numpy()


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, tuple[np.ndarray, ...]]:
    """The checked command line and the data (the batch size is checked against it)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=positive(int), default=20)
    p.add_argument("--batch-size", type=positive(int), default=32)
    p.add_argument("--lr", type=positive(float), default=3e-3)
    p.add_argument("--noise", type=positive(float), default=0.3)
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument("--device", choices=("cpu", "cuda"), default=None)
    p.add_argument("--torch", action="store_true",
                   help="train the torch.nn U-Net after convfuse.torch.convert()")
    args = p.parse_args(argv)
    if args.torch and importlib.util.find_spec("torch") is None:
        p.error("--torch needs PyTorch: pip install torch")
    data = load_data(args.noise, args.seed)
    check_batch_size(p, args.batch_size, len(data[0]))
    return args, data


def main(argv: list[str] | None = None) -> None:
    args, data = parse(argv)
    start = time.perf_counter()
    denoised = (train_torch if args.torch else train_convfuse)(data, args)
    _, _, noisy, clean = data
    before, after = psnr(noisy, clean), psnr(denoised, clean)
    print(f"trained in {time.perf_counter() - start:.1f} s")
    print(f"test PSNR: noisy {before:.2f} dB, denoised {after:.2f} dB")
    print(f"PSNR gain: {after - before:.2f} dB")


if __name__ == "__main__":
    main()
