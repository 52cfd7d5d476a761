"""The cuDNN engine: the ops of DESIGN.md on CuPy arrays, through plans and the binding.

Modules: conv, activation, pooling (the ops); fused (the fused forward and its unfused
fallback); ranked (one call with a plan's ranked algorithms and its workspace); handle
(per-thread handles, workspace, error context); device (DeviceArray and the ExecContext
every call runs in: Note [the pointer path]). Submodules are imported on first use
(convfuse.ops._checks.engine), so importing this package needs neither a GPU nor the
custom kernels.

Reached only through convfuse.ops, which has validated every array: these functions
assume CuPy arrays or DeviceArrays of one supported dtype, the geometry's shapes,
C-contiguous, 16-byte aligned, on the current device.
"""
