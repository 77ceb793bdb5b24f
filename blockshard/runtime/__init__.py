"""blockshard.runtime."""
