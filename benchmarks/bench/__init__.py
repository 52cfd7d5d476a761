"""The pieces of benchmarks/fused_vs_unfused.py: cases, timing, roofline, report.

Nothing here is part of convfuse itself; the script puts this folder on sys.path.
"""
