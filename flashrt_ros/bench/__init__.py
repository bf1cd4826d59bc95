"""Benchmarks: each module is runnable with ``python -m`` and prints ratios measured side by side."""
