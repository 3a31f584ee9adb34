"""`opttx.optim`: opttx transforms as ``torch.optim.Optimizer`` objects.

`Optimizer` runs any transform in place on ``p.grad`` (`opttx.optim.optimizer`); `SGD`,
`Adam`, `AdamW`, ... are torch.optim's classes under their names, with torch's signatures,
defaults, errors and numbers, built on opttx transforms (`opttx.optim.torch_names`).
"""

from . import torch_names
from .optimizer import Optimizer
from .torch_names import SGD, Adafactor, Adagrad, Adam, Adamax, AdamW, Muon, NAdam, RAdam, RMSprop

__all__ = ["Optimizer", *torch_names.__all__]
