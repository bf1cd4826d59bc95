"""Optional accelerated paths, per device. The torch reference path (``runtime.models``,
``runtime.gated_delta``, ``runtime.attention``) is the default, matches transformers and runs on
a GPU; a backend adds at most one path per op, and only where it earns its place in the bench
or gives what torch cannot (batch-invariant rows for speculative verify)."""
