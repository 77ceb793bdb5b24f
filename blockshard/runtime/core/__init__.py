"""The engine core: state machines, buffer sets, collectives, gradient sync, per-module state.

The lowest layer of the runtime: it imports the planner and semantics, never the quantized,
checkpoint or routes layers above it (tests/test_layers.py checks it).
"""
