r"""Heterogeneous memory: optimizer state by chunks on the host or on the device, and each
chunk's update where its state lives (ColossalAI's Gemini, DeepSpeed's ZeRO-Offload).

The parameters are packed into chunks as `zero_plan` packs them (whole parameters, in tree
order, one dtype per chunk). A *placement* puts a fraction of the chunks' optimizer state in
host memory, the rest on the device; `offload_plan` shows it. Each step then runs the same
transform once per chunk: a host chunk's gradients (and parameters) are copied to the host, its
update runs on the CPU (eagerly, or compiled by Inductor into one vectorized C++ loop over the
chunk with ``layout="flat", compile=True``) and the updates go back to the device; a device
chunk's update runs on the device. On CUDA the copies run on side streams into pinned staging
buffers, so the device chunks compute while the host ones are copied and computed.

Why chunks give the same numbers: a transform whose traits say ``per_leaf`` computes each
leaf's output from that leaf alone, so running it on the leaves of one chunk at a time is
running it on all leaves at once (its step counters advance once per call, in every chunk
alike). An ``elementwise`` chain may even see each chunk as one flat vector (``layout="flat"``,
as `opttx.flatten`). A chain that takes a statistic across leaves and keeps state (Prodigy)
cannot be cut into chunks and is refused; stateless statistics across leaves at the head of a
`opttx.chain` (`opttx.clip_by_global_norm`) run first, on the device, over every leaf; a
wrapper declared to run its inner transform on the whole updates (`opttx.apply_if_finite`)
runs around the chunks.

The state is the transform's own state over the parameter tree, laid out exactly as without
offload (a host chunk's tensors simply live in host memory), so checkpoints
(`opttx.distributed.state_dict`) have the same keys with and without offload, and
`set_hyperparams_`, `opttx.Optimizer` and the wrappers see what they expect.
"""

from __future__ import annotations

from typing import Any, Callable

from .._checks import check_nonnegative
from ..base import GradientTransformation, Params, State, Updates, combine_traits, declare
from ..tree import PyTree, tree_flatten, tree_unflatten
from .chunk_plan import state_costs
from .chunk_state import keyed_paths  # noqa: F401 - importable from here, as before
from .chunkable import check_offloadable, inside_wrappers, peel_wrappers
from .masters import OffloadMasterState
from .offload_engine import OffloadStats, Offloader
from .placement import (DEFAULT_CHUNK_MB, OffloadChunk, OffloadPlan, check_chunk_size_mb,
                        check_host_group_mb, offload_plan, place_chunks, validated_fraction)

# The engine's parts live in their own modules: the chunks and their placement
# (`opttx.distributed.placement`), which transforms run by chunks
# (`opttx.distributed.chunkable`), the chunks' states (`opttx.distributed.chunk_state`), the
# copies (`opttx.distributed.staging`), the master copies (`opttx.distributed.masters`), the
# host step (`opttx.distributed.host_step`), the background steps
# (`opttx.distributed.scheduling`) and the engine that joins them
# (`opttx.distributed.offload_engine`). Their public names stay importable from here.
__all__ = ["OffloadChunk", "OffloadMasterState", "OffloadPlan", "OffloadStats",
           "check_offloadable", "offload", "offload_plan", "place_chunks"]


@declare(same_state_as="tx")
def offload(tx: GradientTransformation, fraction: float | str = 1.0, *,
            chunk_size_mb: float = DEFAULT_CHUNK_MB, layout: str = "leaves",
            compile: bool = False, device_budget_mb: float | None = None,
            memory_probe: Callable[[], tuple[int, int]] | None = None,
            stats: OffloadStats | None = None, overlap: bool = False,
            delayed: bool = False, master_params: bool = False,
            host_group_mb: float | None = None) -> GradientTransformation:
    r"""Run ``tx`` with a fraction of its optimizer state, and that part's update, on the host.

    The parameters are packed into chunks (`offload_plan`); the state of the chunks the
    placement puts on the host lives in host memory, and every step, chunk by chunk:

    .. math::
        (u_C, s_C') = \mathrm{tx.update}(g_C, s_C, x_C) \quad \text{on the host for a host
        chunk } C \text{ (} g_C, x_C \text{ copied there, } u_C \text{ copied back), on the
        device otherwise,}

    so a step equals ``tx`` on all leaves (bitwise: the same kernels on the same numbers,
    chunk by chunk) for any chain `check_offloadable` accepts: its links work leaf by leaf
    (``Traits.per_leaf``: adamw, lion, adafactor, came, lamb, 8-bit states, ...), after
    stateless statistics across leaves at its head (`opttx.clip_by_global_norm`, run on the
    device over every leaf first). A wrapper declared to call its inner transform on the
    whole updates (`opttx.extend.declare`'s ``wraps``: `opttx.apply_if_finite`, `opttx.multi_steps`)
    runs around the chunks: ``offload(apply_if_finite(adamw(...), 5))``
    is ``apply_if_finite(offload(adamw(...)), 5)``, one skip decision over every chunk, with
    the same state. Other chains that keep a statistic across leaves are refused with the
    reason; wrap them around the offloaded transform instead
    (``MultiSteps(offload(adamw(...)), 4)``).

    On CUDA each host chunk's gradients and parameters are copied on a side stream into
    pinned staging buffers, the device chunks' updates are queued meanwhile, each host chunk
    computes as soon as its copy has landed, and its updates return on a second side stream
    that the caller's stream waits for (no blocking copy on the device's critical path). On a
    CPU-only machine the copies are plain ordered copies.

    Args:
      tx: the transform (a chain, an alias).
      fraction: the share of the optimizer state to keep on the host, in [0, 1] (the last
        chunks in tree order, `place_chunks`), or ``"auto"``: everything on the host for the
        first step (the warm-up); after its forward and backward, the device memory left
        beside the peak measured so far (``torch.cuda.max_memory_allocated``; less 10 % of
        the device's memory) is the budget, and the first chunks whose state fits move to the
        device. ``device_budget_mb`` gives the budget instead of measuring it.
      chunk_size_mb: the chunk capacity in MiB of parameters (`offload_plan`).
      layout: ``"leaves"`` (default): ``tx`` sees each chunk's leaves in the parameter tree
        (others masked); right for every per-leaf chain. ``"flat"``: ``tx`` sees each chunk
        as one flat vector (`opttx.flatten`), for element-wise chains only: one kernel per
        op and chunk, and with ``compile`` one vectorized loop per chunk. Masks and
        partitions inside ``tx`` then see the flat vector, as with `opttx.flatten`.
      compile: compile the host chunks' update for the CPU with ``torch.compile`` (Inductor;
        the state written in place; the C++ compiler may contract a multiply and an add
        into one fused multiply-add, as DeepSpeed's CPU Adam does: on a 2-core Xeon the
        loop is then as fast as DeepSpeed's). Inductor's kernels round differently from
        eager ones in the last bits (measured, ``benchmarks/offload_compiled_error.py``:
        AdamW's parameters within 0.44 ulp of each leaf's largest magnitude over 6 steps,
        2.4e-7 absolute on a randn leaf; relative to an element near zero that is larger,
        1e-4 at 9e-6), so the bitwise equality with ``tx`` holds with ``compile=False``
        (default). Any chain that offloads compiles so: with ``layout="leaves"`` each
        chunk's step for its leaves' shapes (static), the flat layout's loop with dynamic
        shapes.
      device_budget_mb: with ``"auto"``, the device memory (MiB) for optimizer state.
      memory_probe: with ``"auto"``, ``() -> (peak bytes in use, device capacity bytes)``
        instead of the CUDA counters (tests pass a fake one).
      stats: an `OffloadStats` that records the plan, the chunk steps and the bytes copied.
      overlap: start each host chunk's step during backward, as soon as the gradients of
        all its parameters are there (`opttx.distributed.BackwardLaunches`: post-accumulate-
        grad hooks; the copy to the host and the step run while backward goes on, the step
        on a worker thread); ``update`` then collects them. ``init`` must get the model's
        parameters themselves (``dict(model.named_parameters())``; `opttx.Optimizer` hands
        ``init`` detached copies, so there ``init`` raises a ``ValueError``: run the
        functional loop, docs/guide/offload.md), ``update`` the ``.grad`` tensors backward
        left and the state the last update returned (otherwise the chunks run in
        ``update``). Eager; the statistics across
        leaves at a chain's head (global-norm clipping) need every gradient first, so they
        are refused with it; in gradient accumulation, run the micro-batches before the last
        inside `opttx.distributed.no_sync`. A step started in backward runs functionally
        (its starting state stays intact until ``update`` takes the result): with
        ``compile=True`` one more pass over the chunk's state, eagerly new buffers. A
        checkpoint loaded into the state in place since the last ``update``
        (`opttx.Optimizer.load_state_dict`) makes ``update`` drop the steps started and run
        those chunks itself (the state's version counters moved).
      delayed: the one-step delayed parameter update of ZeRO-Offload (DPU): ``update`` at step
        :math:`t` starts the host chunks' step on step :math:`t`'s gradients in the
        background and returns, for those chunks, the updates computed from step
        :math:`t-1`'s (zeros at the first step), so the host computes while the device runs
        the next forward and backward. A different optimizer: the offloaded parameters
        move by :math:`u(g_{t-1}, x_{t-1})` at step :math:`t`, one step late (check it for
        your model; the paper starts the delay after a few dozen warm-up steps, this option
        from the first). The state ``update`` returns has the host chunks as of step
        :math:`t-1` (a checkpoint drops the step in flight; a run resumed from it moves
        the host chunks by zero at its first step, and so does a run whose live state a
        checkpoint was loaded into, `opttx.Optimizer.load_state_dict`: the steps in flight
        then came from the replaced state and are dropped). Not with ``overlap``.
      master_params: keep the host chunks' parameters on the host too, as ZeRO-Offload does:
        a master copy (float32 for 16-bit parameters, their own dtype otherwise; pinned on
        CUDA), allocated by ``init``, started from the parameters at the first ``update``
        and stepped there, :math:`x_C \leftarrow x_C + u_C` in the same loop as the update (with
        ``compile``, one pass over gradient, state and master: what DeepSpeed's CPU Adam
        reads and writes). The parameters are then not copied to the host each step; the
        new values go to the device instead of the updates (in the parameters' dtype), and
        ``update`` returns for those leaves :math:`\mathrm{fl}(x_C' - x)`, computed on the
        device, so that applying it gives the master's values: exactly whenever a
        parameter's new value is within a factor 2 of its old one (Sterbenz's lemma; a step
        that crosses zero may land one rounding of the difference away, and the next step
        starts again from the master). For 16-bit parameters this is the float32 master
        copy of mixed-precision training: updates below half a bf16 ulp accumulate instead
        of vanishing (`opttx.Optimizer`'s ``stochastic_rounding`` is the alternative
        without a copy). The master is part of the state (`OffloadMasterState`): in place
        inside `opttx.donating` (`opttx.Optimizer`), else into a new buffer, so a state
        given again (a step `opttx.apply_if_finite` dropped) steps from its own master. In
        checkpoints its entries are optional (``"~master"``, ``"~started"``,
        `opttx.extend.declare_optional`): a run resumed from one continues bit for bit, a run
        without the master skips them, and a checkpoint without them (or a state of ``tx``
        alone given to ``update``) starts the master from the parameters, which for 16-bit
        parameters drops its extra bits. Write parameters through the optimizer while it
        runs (the master overwrites other changes; a checkpoint loaded into both the model
        and the optimizer is such a write). With ``overlap`` a step started in backward
        writes the chunk's second master buffer (4 more bytes per parameter on the host),
        which ``update`` swaps in when it takes the step, so a step it drops leaves the
        master as it was. Not with ``delayed``.
      host_group_mb: with ``compile``, the host chunks whose step ``update`` runs itself
        (not those ``overlap`` started in backward) go in groups of consecutive chunks of at
        most this many MiB of parameters, each group one compiled call: the chunks' loops
        run back to back with no Python between them. After a loop over tens of MB the
        caches hold its data, not the interpreter's, and each compiled call's Python takes
        about 0.3 ms instead of 0.04 (2-core Xeon; benchmarks/offload_host_loop.py): with
        32 MiB chunks, about a tenth of the host step (benchmarks/offload.py, AdamW on
        96 M parameters: one call per chunk 1.11x DeepSpeedCPUAdam's time, grouped 0.98x,
        0.983x paired round by round over 100 rounds). The group's chunks share one copy of
        the step count (written once, after all their steps), so their scalar work (bias
        corrections) is computed once, ahead of all the loops
        (`opttx.kernels.CoefficientsFirst`).
        On CUDA a group starts when the copies of all its chunks have landed (a larger
        group overlaps less of the copies to the host with the steps). Each chunk's numbers
        are those of its step alone.
        Default None: one call per chunk. Not with ``delayed``.

    Returns:
      A `GradientTransformation` whose state is ``tx``'s state, laid out as without offload
      (checkpoints move between offloaded runs and runs without offload), its host chunks'
      tensors in host memory; with ``master_params`` an `OffloadMasterState` holding it and
      the master copy (keyed in checkpoints as ``tx``'s state alone, plus the master's
      optional entries). The plan is resolved by ``init`` (or by the first ``update``
      after a restore) and kept: one ``offload`` transform per parameter tree.

    Example:
      >>> tx = opttx.distributed.offload(opttx.adamw(1e-3), fraction=0.5)
      >>> opt = opttx.Optimizer(model.parameters(), tx)      # or functionally:
      >>> state = tx.init(params)
      >>> updates, state = tx.update(grads, state, params)

    References:
      Ren et al., ZeRO-Offload: Democratizing Billion-Scale Model Training (arXiv
      2101.06840); Fang et al., PatrickStar (arXiv 2108.05818), the chunks and placement of
      ColossalAI's Gemini.
    """
    if not isinstance(tx, GradientTransformation):
        raise TypeError(f"offload needs a GradientTransformation, got a {type(tx).__name__} "
                        "(did you forget to call the factory?).")
    fraction = validated_fraction(fraction, "offload")
    check_chunk_size_mb(chunk_size_mb)
    if overlap and delayed:
        raise ValueError("offload: overlap and delayed do not go together: delayed already "
                         "runs each host step behind the next forward and backward.")
    check_host_group_mb(host_group_mb, compile, delayed, "offload")
    if master_params and delayed:
        raise ValueError("offload: master_params is not implemented with delayed (its host "
                         "steps run one step behind the parameters the master would follow).")
    if device_budget_mb is not None:
        check_nonnegative("device_budget_mb", device_budget_mb)
        if fraction != "auto":
            raise ValueError("offload: device_budget_mb goes with fraction='auto'.")
    if memory_probe is not None and fraction != "auto":
        raise ValueError("offload: memory_probe goes with fraction='auto'.")
    wrappers, core = peel_wrappers(tx, layout)
    if check_offloadable(core, layout) and overlap:
        raise ValueError("offload(overlap=True): the chain starts with a statistic across "
                         "leaves (global-norm clipping), which needs every gradient before "
                         "any chunk's step; clip inside backward's reach is impossible, so "
                         "use overlap=False (or clip per leaf: clip_by_block_rms).")

    def make() -> Offloader:
        return Offloader(core, fraction, layout=layout, compile=compile,
                         budget_mb=device_budget_mb, memory_probe=memory_probe,
                         where="offload", stats=stats, overlap=overlap, delayed=delayed,
                         master_params=master_params, host_group_mb=host_group_mb)

    resolved: list[Offloader] = []

    def resolve(tree: PyTree) -> Offloader:
        engine = make()
        engine.resolve(tree, costs=state_costs(core, tree), chunk_size_mb=chunk_size_mb)
        resolved[:] = [engine]
        return engine

    adopt = [False]
    # the chunks' run, inside the wrappers peeled off tx (apply_if_finite: one decision over
    # every chunk)
    running = inside_wrappers(wrappers, core, lambda: resolved[0], adopt)

    def init(params: Params) -> State:
        from ..base import check_init_params
        check_init_params(params)
        engine = resolve(params)
        adopt[0] = False
        state = running.init(params)
        if overlap:
            engine.hook(params)
        return state

    def update(updates: Updates, state: State, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, State]:
        if not resolved:              # a restored state: planned from the updates, adopted
            resolve(updates)          # by the engine at its first run
            adopt[0] = True
        engine = resolved[0]
        leaves, spec = tree_flatten(updates)
        if spec != engine.spec or any(tuple(x.shape) != s for x, s in zip(leaves, engine.shapes)):
            from ..tree import assert_same_structure
            template = tree_unflatten(list(engine.shapes), engine.spec)
            assert_same_structure(updates, template, "updates and the params given to init")
            raise ValueError("offload: the updates' shapes differ from the params given to "
                             f"init: {[tuple(x.shape) for x in leaves]} vs {engine.shapes}.")
        return running.update(updates, state, params, **extra_args)

    return GradientTransformation(init, update, combine_traits((tx,)))
