"""Checks of hyperparameters and inputs for transforms of your own, run once at construction
(docs/design.md, rule 7): they check Python numbers and let 0-dim tensors (injected
hyperparameters, whose values a compiled step cannot read) and schedules through.

Example:
  >>> @opttx.extend.declare(hyperparams={"b": opttx.extend.HyperRole.B1})
  ... def scale_by_sign_momentum(b: float = 0.9):
  ...     opttx.checks.check_unit_interval("b", b)     # a number in [0, 1), or a tensor
  ...     ...
"""

from ._checks import (check_floating, check_nonnegative, check_number, check_positive,
                      check_positive_int, check_unit_interval)

__all__ = ["check_floating", "check_nonnegative", "check_number", "check_positive",
           "check_positive_int", "check_unit_interval"]
