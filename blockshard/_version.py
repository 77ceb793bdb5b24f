"""blockshard's version, in one place below every layer (the checkpoint record writes it)."""

__version__ = "0.1.0.dev0"
