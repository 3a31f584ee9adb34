"""Whether the code running now is being traced by ``torch.compile`` (or ``torch.export``).

``torch.compiler.is_compiling()`` reads one flag per process: while Dynamo compiles a function
on one thread (offload's worker thread compiling a host chunk's step, a user's compile on a
thread of their own), it is True for every thread, and eager code on the others would take its
traced branches (skip a check, keep a state buffer instead of donating it, pick the
traced form of a reduction, which rounds differently). `is_tracing` asks, besides the flag,
whether this thread holds a trace: Dynamo's and export's ``TracingContext`` is thread-local.
"""

from __future__ import annotations

import torch
import torch._dynamo
from torch._guards import TracingContext


@torch._dynamo.assume_constant_result
def is_tracing() -> bool:
    """``torch.compiler.is_compiling()``, and this thread is the one being traced.

    The library reads this wherever it takes a different branch under ``torch.compile``. In
    eager code with no compile anywhere it costs one flag read. Dynamo does not trace into
    it: it calls it once per call site, at trace time (where it is True), and keeps the
    result as a constant, so it costs a trace no more than ``is_compiling`` does. Run for
    real (eager code while another thread compiles; non-strict export, which executes the
    Python), it reads this thread's tracing context.

    Example (code of your own that reads a tensor eagerly, never in a traced step):
      >>> def doubled(x):
      ...     if not opttx.is_tracing():     # a host read: a sync, a graph break if traced
      ...         assert bool(torch.isfinite(x).all())
      ...     return 2 * x
      >>> doubled(torch.ones(3))
    """
    return torch.compiler.is_compiling() and TracingContext.try_get() is not None
