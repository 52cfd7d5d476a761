"""convfuse works with PyTorch absent; convfuse.torch and convfuse.distributed say what to
install. Simulated in a subprocess where `import torch` fails (sys.modules['torch'] = None)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import sys
    sys.modules["torch"] = None  # any `import torch` now raises ImportError
    import numpy as np
    import convfuse as cf
    assert "torch" not in [m for m in sys.modules if sys.modules[m] is not None]
    model = cf.Sequential(cf.Conv2d(1, 2, 3, padding=1, activation="relu", seed=0),
                          cf.Flatten(), cf.Linear(2 * 4 * 4, 3, seed=1))
    opt = cf.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = cf.CrossEntropyLoss()
    x = np.random.default_rng(0).random((2, 1, 4, 4), dtype=np.float32)
    before = float(loss_fn(model(x), np.array([0, 1])))
    for _ in range(5):
        opt.zero_grad()
        loss_fn(model(x), np.array([0, 1]))
        model.backward(loss_fn.backward())
        opt.step()
    assert float(loss_fn(model(x), np.array([0, 1]))) < before
    import convfuse.distributed as d  # importable; needs torch only when called
    try:
        d.allreduce_gradients(opt)
    except ImportError as exc:
        assert "pip install torch (convfuse's `torch` extra" in str(exc), exc
    else:
        raise AssertionError("allreduce_gradients ran without torch")
    try:
        import convfuse.torch  # noqa: F401
    except ImportError as exc:
        assert "pip install torch (convfuse's `torch` extra" in str(exc), exc
    else:
        raise AssertionError("convfuse.torch imported without torch")
    print("ok")
""")


def test_convfuse_works_without_torch():
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(ROOT),
                                                       "OMP_NUM_THREADS": "1", "PATH": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"


def test_an_old_torch_is_refused_by_name():
    """A PyTorch older than the oldest convfuse.torch has run on is an ImportError naming
    both versions, raised before the bridge imports anything of it."""
    code = textwrap.dedent("""
        import torch
        torch.__version__ = "2.4.1+cpu"
        try:
            import convfuse.torch
        except ImportError as exc:
            print(exc)
        else:
            print("imported")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "needs PyTorch 2.11 or later, found 2.4.1+cpu" in proc.stdout, proc.stdout
