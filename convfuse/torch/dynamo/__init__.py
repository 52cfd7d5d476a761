"""convfuse inside torch.compile: `torch.compile(model, backend="convfuse")` fuses the
convolution -> [batch norm] -> [+ residual] -> activation chains of any model's Dynamo graph
into convfuse's ops (what `convert()` cannot see outside an nn.Sequential), and
`explain(model, *inputs)` says what was fused and what was left, and why."""

from .backend import backend, convfuse
from .explain import Explanation, explain
from .rewrite import Record, fuse

__all__ = ["Explanation", "Record", "backend", "convfuse", "explain", "fuse"]
