"""Adapters into existing engines, imported as ``blockshard.integrations.*``.

They depend on blockshard's core; the core never imports them. They import each other relatively
(``from ._settings import ...``): mypy checks this folder as the package ``integrations`` (it cannot
follow setuptools' package-dir mapping), and a relative import resolves under either name.
"""
