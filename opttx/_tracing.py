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


@torch._dynamo.assume_constant_result
def _traced_here() -> bool:
    """Whether this thread is tracing: Dynamo evaluates this once, at trace time, as a
    constant; run for real (eager code while another thread compiles, or non-strict export,
    which executes the Python), it reads the thread's tracing context."""
    from torch._guards import TracingContext
    return TracingContext.try_get() is not None


def is_tracing() -> bool:
    """``torch.compiler.is_compiling()``, and this thread is the one being traced.

    The library reads this wherever it takes a different branch under ``torch.compile``. In
    eager code with no compile anywhere it costs one flag read.

    Example (a transform of your own that checks a value eagerly but not when traced):
      >>> if not opttx.is_tracing():
      ...     check_finite(value)        # reads the tensor: a sync, a graph break
    """
    return torch.compiler.is_compiling() and _traced_here()
