"""Tiny models and data built in code (nothing downloads): ``tiny_llama`` (a transformers
``LlamaForCausalLM``), ``OddMLP`` (odd shapes), and their batches (``text_batches`` of the bytes of
``TEXT``, ``mlp_batches``), deterministic on every rank."""

from blockshard._tiny import TEXT, OddMLP, mlp_batches, text_batches, tiny_llama

__all__ = ["TEXT", "OddMLP", "mlp_batches", "text_batches", "tiny_llama"]
