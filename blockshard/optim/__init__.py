"""blockshard.optim."""

from blockshard.optim._shampoo import BlockedShampoo

__all__ = ["BlockedShampoo"]
