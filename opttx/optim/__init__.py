"""`opttx.optim`: opttx transforms as ``torch.optim.Optimizer`` objects.

`Optimizer` runs any transform in place on ``p.grad`` (`opttx.optim.optimizer`).
"""

from .optimizer import Optimizer

__all__ = ["Optimizer"]
