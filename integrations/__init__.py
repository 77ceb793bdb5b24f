"""Adapters into existing engines, imported as ``blockshard.integrations.*``.

They depend on blockshard's core; the core never imports them.
"""
