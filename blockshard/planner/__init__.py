"""blockshard.planner."""
