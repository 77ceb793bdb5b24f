"""Which blockwise-state semantics an optimizer class needs, from its module and class name (pure:
imports neither torch nor the optimizer's library)."""

from __future__ import annotations

__all__ = ["SHAMPOO_DEFAULT_DIM", "blockwise_state_semantics", "tile_state_semantics"]

#: BlockedShampoo's ``max_preconditioner_dim`` when a class (not an instance) is given.
SHAMPOO_DEFAULT_DIM = 1024


def _in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def blockwise_state_semantics(module: str, name: str) -> str | None:
    """The block semantics of a blockwise 8-bit (4-bit) optimizer's state, from its class's
    ``__module__`` and ``__name__``: ``"bnb8bit"`` for a bitsandbytes class with ``8bit`` in its
    name (``bitsandbytes.optim.adamw.AdamW8bit``), ``"ao8bit"`` / ``"ao4bit"`` for a torchao class
    whose name ends in ``8bit`` / ``4bit`` (``torchao.optim.adam.AdamW8bit``); None for any other."""
    if _in_package(module, "bitsandbytes") and "8bit" in name:
        return "bnb8bit"
    if _in_package(module, "torchao") and name.endswith("8bit"):
        return "ao8bit"
    if _in_package(module, "torchao") and name.endswith("4bit"):
        return "ao4bit"
    return None


def tile_state_semantics(name: str, max_preconditioner_dim: int | None) -> str | None:
    """The block semantics of a tiled optimizer's preconditioners, from its class's ``__name__`` and
    the ``max_preconditioner_dim`` of the param_group it steps: ``"shampoo:D"`` for blockshard's
    ``BlockedShampoo`` (``D x D`` tiles; :data:`SHAMPOO_DEFAULT_DIM` when None), None for any other."""
    if name != "BlockedShampoo":
        return None
    return f"shampoo:{max_preconditioner_dim or SHAMPOO_DEFAULT_DIM}"
