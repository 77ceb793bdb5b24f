"""blockshard.optim."""
