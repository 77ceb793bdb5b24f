"""Checkpoints and state dicts: ``PieceTensor`` entries, full and sharded state dicts, optimizer
state by name, DCP checkpoints, safetensors loading and export. Imports the engine core and the
quantized layer; defines the codec protocol optimizers implement to place their own state.
"""
