"""lightning-merak: systems techniques for training large models with PyTorch Lightning.

Importing the package registers its strategies in Lightning's ``StrategyRegistry``.
"""

from lightning_merak.strategies import register_strategies

__version__ = "0.1.0"

register_strategies()

__all__ = ["__version__", "register_strategies"]
