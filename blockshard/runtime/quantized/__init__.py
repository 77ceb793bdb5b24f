"""Quantized weights in the engine: frozen quantized weights sharded as bytes (one module per
format: bitsandbytes 4-bit, torchao NF4, MX, blockwise FP8) and trainable weights gathered
quantized. Imports the engine core only.
"""
