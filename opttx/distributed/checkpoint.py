r"""Checkpoints of any opttx state: nested dicts of (D)Tensors keyed by parameter path.

`torch.distributed.checkpoint` (DCP) saves nested dicts of tensors and pickles anything else
whole, so a state of NamedTuples would be one opaque object that no other world size can
read. `state_dict` turns a state into plain dicts with string keys, `load_state_dict` copies
such a dict back into the state that ``tx.init`` built for the *current* run:

.. code-block:: text

    {"state":  {param path: {field path: tensor}},   # what belongs to one parameter
     "shared": {field path: tensor}}                  # the rest: step counts, maps, ...

A **param path** names a leaf of the parameter tree (``"layers.0.w"``: dict keys, list indices
and attribute names joined by dots). A **field path** names a tensor inside that parameter's
part of the state: the path from the root of the state to the node shaped like the parameter
tree (``"1.mu"``: link 1 of a chain, field ``mu``), then the path below the parameter's
position (``".0.factors.1"`` for the second Kronecker factor of the first Shampoo block).
Neither depends on which leaves a rank holds, so the keys are the same whether the state is
the single-device one or a rank's share under `zero` or `on_owners` (there the leaves other
ranks own are `opttx.MaskedNode` and simply have no entry): every rank writes exactly the
leaves it owns, and after a restart at another world size every rank reads the leaves its new
plan gives it. A zero checkpoint even loads into the plain single-device transform.

States that keep per-leaf lists whose indices depend on the leaves present (`quantize_state`:
the large leaves' states in leaf order, the small ones' in one inner state over a list) are
keyed through those lists by the same param paths.

Shared tensors (a chain's step count) are the same on every rank and written once (DCP keeps
one copy of a plain tensor saved by several ranks).

**Local shards** (plain `sharded`, FSDP2): a state tensor shaped like the local shard of a
sharded parameter (Adam's moments, a momentum buffer) is returned as a ``DTensor`` with the
parameter's placements, so DCP stores the whole tensor once and any other sharding reads its
own piece: no gather at save time, and a restart reshards. That needs the torch.chunk-like
splits DTensor describes (every FSDP2 and even split); explicit uneven `Shard` sizes are
refused with an error, as are sharded statistics of another shape (Adafactor's row and column
means on local shards): run those transforms under `on_owners` (whole leaves) to checkpoint
them, or gather the parameters first. Gathering whole tensors at save time would lift both
limits at the cost of one whole-tensor copy per rank and a collective per leaf; DTensors keep
the save free of communication and the memory at that of the shards.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from .checkpoint_files import save_checkpoint, verify_checkpoint
from .checkpoint_metadata import SafeLoadPlanner, read_metadata, safe_reader, unwrap_refusal
from .checkpoint_keys import (
    dtensor_placement,
    keyed_state,
    local_entries_as_dtensors,
    param_paths,
)
from ..base import format_identity, is_optional_entry
from ..tree import PyTree, Static, tree_flatten
from .shapes import is_dtensor, raise_on_every_rank

__all__ = ["check_checkpoint", "load_checkpoint", "load_state_dict", "param_paths",
           "read_metadata", "save_checkpoint", "state_dict", "verify_checkpoint"]

STATE, SHARED, MADE_BY = "state", "shared", "made_by"


def _stamps(state: Any, path: tuple = ()) -> dict[str, Any]:
    """The ``made_by`` of every state node that has one (see `opttx.extend.declare`), by the path
    of the node in the state (``"0"``: link 0 of a chain; ``"state"``: the root)."""
    out: dict[str, Any] = {}
    made = getattr(state, "made_by", None) if isinstance(state, tuple) else None
    if isinstance(made, Static) and made.value is not None:
        out[".".join(map(str, path)) or "state"] = made.value
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        children = [(f, getattr(state, f)) for f in state._fields if f != "made_by"]
    elif isinstance(state, (tuple, list)):
        children = list(enumerate(state))
    elif isinstance(state, Mapping):
        children = list(state.items())
    else:
        children = []
    for key, child in children:
        out.update(_stamps(child, path + (key,)))
    return out


def _stamp_entries(state: Any) -> dict[str, str]:
    """``{digest: identity}`` of the state's ``made_by`` stamps: one entry per distinct
    transform and configuration (not per place in the state, which may depend on the leaves
    a rank holds), so every rank writes the same entries and a checkpoint moves between world
    sizes. The digest in the key lets `check_checkpoint` tell from the metadata alone that a
    checkpoint was made by another transform or configuration; the value names it."""
    out = {}
    for identity in _stamps(state).values():
        text = format_identity(identity)
        out[hashlib.sha1(text.encode()).hexdigest()[:12]] = text
    return out


def _check_stamps(mine: Mapping[str, str], theirs: Mapping[str, str] | None,
                  where: str) -> None:
    """Refuse a checkpoint that lacks one of this run's ``made_by`` entries (its state was
    made by another transform or configuration), naming both sides."""
    if theirs is None:
        return
    missing = [v for k, v in mine.items() if k not in theirs]
    if not missing:
        return
    extra = [v for k, v in theirs.items() if k not in mine]
    raise ValueError(f"{where}: the checkpoint's optimizer state was made by another "
                     f"transform or configuration: this run's state is made by "
                     f"{'; '.join(missing[:2])}, the checkpoint's by "
                     f"{'; '.join(extra[:2]) or 'nothing declared'}. Nothing was written; "
                     "build the transform that saved it.")


def _owned_mask(owned: Any, n: int) -> list[bool] | None:
    if owned is None:
        return None
    if hasattr(owned, "owned") and hasattr(owned, "leaves"):       # OwnerPlan
        if any(getattr(owned, "split", lambda: ())()):
            raise ValueError("checkpoints of an on_owners plan that splits leaves into row "
                             "segments (split_above_mb) are not supported: each rank holds "
                             "rows of those leaves' state, which the keys cannot reassemble "
                             "yet. Save with split_above_mb=None.")
        mask = list(owned.owned())
    elif hasattr(owned, "owners") and hasattr(owned, "chunks"):    # ZeroPlan
        if getattr(owned, "units", ()):
            raise ValueError("checkpoints of a zero plan that splits parameters into row "
                             "segments (split_above_mb) are not supported: each rank holds "
                             "rows of those leaves' state, which the keys cannot reassemble "
                             "yet. Save with split_above_mb=None.")
        rank = dist.get_rank() if dist.is_initialized() else 0
        mask = [r == rank for r in owned.owners]
    else:
        mask = [bool(x) for x in owned]
    if len(mask) != n:
        raise ValueError(f"owned has {len(mask)} entries for {n} parameter leaves.")
    return mask


# ---------------------------------------------------------------------------------------------
# local shards -> DTensors
# ---------------------------------------------------------------------------------------------


def _placements_of(param: Any, spec: Any) -> tuple[Any, Any, tuple[int, ...]] | None:
    """(mesh, placements, global shape) of a sharded leaf, or None when it is whole."""
    from torch.distributed.tensor import DeviceMesh
    from torch.distributed.tensor import Shard as DShard
    if is_dtensor(param):
        return dtensor_placement(param)
    shards = tuple(s for s in (spec or ()) if s is not None) if isinstance(spec, tuple) \
        else ((spec,) if spec is not None and hasattr(spec, "dim") else ())
    if not shards:
        return None
    if len(shards) != 1:
        raise NotImplementedError("Checkpoints of a leaf sharded over several groups need "
                                  "DTensor parameters (a DeviceMesh); pass them as DTensors.")
    s = shards[0]
    group = s.group
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    local = tuple(param.shape)
    # the global size along the dim: one small collective
    total = torch.tensor([local[s.dim]], dtype=torch.int64, device=param.device)
    dist.all_reduce(total, group=group)
    n = int(total)
    chunk = -(-n // world)
    expected = max(0, min(chunk, n - rank * chunk))
    error = None if expected == local[s.dim] else NotImplementedError(
        f"A leaf split unevenly along dim {s.dim} ({local[s.dim]} of {n} elements on rank "
        f"{rank} of {world}, torch.chunk would give {expected}) cannot be described as a "
        "DTensor for checkpoints; use even (torch.chunk-like) splits or on_owners.")
    raise_on_every_rank(error, group)     # not one rank raising, the others waiting
    mesh = DeviceMesh.from_group(group, device_type=param.device.type)
    shape = list(local)
    shape[s.dim] = n
    return mesh, (DShard(s.dim),), tuple(shape)


def _as_dtensors(table: dict, params: PyTree, specs: PyTree | None, per_rank: bool,
                 layouts: dict | None = None) -> dict:
    """Per-parameter entries shaped like a sharded parameter's local shard as DTensors."""
    from .specs import flatten_specs
    leaves = tree_flatten(params)[0]
    if not any(is_dtensor(x) for x in leaves) and specs is None:
        return table
    flat_specs = flatten_specs(params, specs) if specs is not None else [()] * len(leaves)
    # every rank resolves every leaf, in order (a collective per explicitly sharded leaf)
    placed = [_placements_of(leaf, spec) for leaf, spec in zip(leaves, flat_specs)]
    rank = (dist.get_rank() if dist.is_initialized() else 0) if per_rank else None
    return local_entries_as_dtensors(table, param_paths(params), leaves, placed, rank=rank,
                                     layouts=layouts)


# ---------------------------------------------------------------------------------------------
# the public functions
# ---------------------------------------------------------------------------------------------


def state_dict(state: Any, params: PyTree, *, specs: PyTree | None = None,
               owned: Any = None, per_rank: bool = False) -> dict[str, dict]:
    """The tensors of an opttx state as nested dicts with string keys, for DCP.

    The tensors are the state's own (no copy): ``dcp.save`` reads them, and ``dcp.load`` into
    a `state_dict` of a freshly initialized state writes straight into its buffers.

    Args:
      state: any opttx state (single device, a rank's share under `zero` or `on_owners`, or
        local shards under `sharded`).
      params: the parameter tree the state belongs to (full, or local shards / DTensors
        under `sharded`): it names the entries.
      specs: under plain `sharded` with plain-tensor parameters, the sharding specs (as given
        to `sharded`) so that local-shard statistics become DTensors; DTensor parameters need
        none.
      owned: which parameter leaves this rank holds state for (a list of booleans, an
        `OwnerPlan` or a `ZeroPlan`). Needed only when nothing in the state says it: no
        field is shaped like the parameter tree and no `quantize_state` plan records the
        leaves (a state of your own under `zero`).
      per_rank: under `sharded`, keep a statistic of a local shard whose layout is not
        declared (neither element-wise, nor a scalar, nor a reduction the state declares as
        Adafactor's and CAME's row and column statistics do) as this rank's own entry,
        ``field path + "@rank<r>"`` (global rank), instead of raising: the checkpoint then
        reloads only at the same world size and sharding (`check_checkpoint` names the
        per-rank entries another world size lacks).

    Returns:
      ``{"state": {param path: {field path: tensor}}, "shared": {field path: tensor}}``: a
      param path names a parameter (``"layers.0.w"``: keys and indices joined by dots), a
      field path the place in the state (``"1.0.mu"``: link 1 of a chain, link 0 inside it,
      field ``mu``) and inside that parameter's part (Shampoo's blocks and factors), so no
      key depends on which leaves a rank holds (see the guide, "Checkpoints"); a sharded
      parameter's element-wise statistics are DTensors.

    Raises:
      NotImplementedError: a statistic of a local shard whose layout is not declared (it
        cannot be resharded), or an uneven split DTensor cannot describe.
      ValueError: ``owned`` of the wrong length, or a `quantize_state` state that does not
        fit the parameters.

    Example:
      >>> import torch.distributed.checkpoint as dcp
      >>> dcp.save({"params": params, "optim": state_dict(state, params)}, checkpoint_id=d)
      >>> state = tx.init(params)                       # at any world size
      >>> sd = {"params": params, "optim": state_dict(state, params)}
      >>> dcp.load(sd, checkpoint_id=d)
      >>> state = load_state_dict(state, sd["optim"], params)
    """
    layouts: dict = {}
    per_param, shared = keyed_state(state, params,
                                    _owned_mask(owned, len(tree_flatten(params)[0])), layouts)
    per_param = _as_dtensors(per_param, params, specs, per_rank, layouts)
    out: dict[str, dict] = {STATE: per_param, SHARED: shared}
    stamps = _stamp_entries(state)
    if stamps:
        out[MADE_BY] = stamps
    return out


def _flat(sd: Mapping[str, Any]) -> dict[str, Any]:
    """The tensors of a state dict by flat key (the ``made_by`` entries are not tensors:
    `_made_by` reads them)."""
    if not isinstance(sd, Mapping) or set(sd) - {STATE, SHARED, MADE_BY}:
        raise ValueError("A state dict of opttx.distributed.state_dict has the keys 'state', "
                         "'shared' and 'made_by'; got "
                         f"{sorted(sd) if isinstance(sd, Mapping) else type(sd)}.")
    out = {f"{STATE}.{p}.{f}": x for p, fields in sd.get(STATE, {}).items()
           for f, x in fields.items()}
    out.update({f"{SHARED}.{f}": x for f, x in sd.get(SHARED, {}).items()})
    return out


def _optional_keys(sd: Mapping[str, Any]) -> set[str]:
    """The flat keys (as `_flat` makes them) of the entries of fields declared optional
    (`opttx.extend.declare_optional`): read from their field paths, so also for entries of a state
    this run does not have."""
    out = {f"{STATE}.{p}.{f}" for p, fields in sd.get(STATE, {}).items() for f in fields
           if is_optional_entry(f)}
    out.update(f"{SHARED}.{f}" for f in sd.get(SHARED, {}) if is_optional_entry(f))
    return out


def _made_by(sd: Mapping[str, Any]) -> dict[str, str] | None:
    """The ``made_by`` entries of a state dict (None for one saved before they existed)."""
    return dict(sd[MADE_BY]) if isinstance(sd, Mapping) and MADE_BY in sd else None


def _describe(keys: Iterable[str]) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:4])
    return shown + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")


def _raise_mismatch(missing: set[str], extra: set[str]) -> None:
    if not missing and not extra:
        return
    parts = []
    if missing:
        parts.append(f"missing {len(missing)} entries of this run's optimizer state "
                     f"({_describe(missing)})")
    if extra:
        parts.append(f"unexpected {len(extra)} entries this run's optimizer state does not "
                     f"have ({_describe(extra)})")
    raise ValueError(f"The checkpoint does not match this run: {'; '.join(parts)}. Was it "
                     "saved with the same transform and parameters?")


@torch.no_grad()
def load_state_dict(state: Any, state_dict: Mapping[str, Any], params: PyTree, *,
                    specs: PyTree | None = None, owned: Any = None, per_rank: bool = False,
                    strict: bool = True) -> Any:
    """Copy a `state_dict` into ``state`` (built by ``tx.init`` for the current run); return
    it.

    ``state_dict`` holds the entries this rank needs (after ``dcp.load`` into the
    `state_dict` of this very state it holds the state's own tensors, and the copy is
    skipped); extra entries are ignored unless ``strict``, where every entry must belong to
    this rank's state. Entries of fields a state declares optional (`opttx.extend.declare_optional`:
    offload's master copy of the parameters, keyed ``"~master"``) may be absent on either
    side: the checkpoint's are ignored where this state has none, and this state's that the
    checkpoint lacks are set to zeros, which such a state reads as absent (offload then
    starts its master copy from the parameters). Use `check_checkpoint` before ``dcp.load``
    to compare the whole checkpoint with the whole run.

    Args:
      state: the template: ``tx.init(params)`` at the current world size.
      state_dict: nested dicts as `state_dict` makes them (tensors or DTensors).
      params, specs, owned, per_rank: as for `state_dict`.
      strict: refuse entries this rank's state does not have.

    Returns:
      ``state``, its buffers overwritten in place.

    Raises:
      ValueError: an entry is missing or unexpected, or has another shape or dtype; the
        message names it.
    """
    built = globals()["state_dict"](state, params, specs=specs, owned=owned,
                                    per_rank=per_rank)
    _check_stamps(_made_by(built) or {}, _made_by(state_dict), "load_state_dict")
    template = _flat(built)
    given = _flat(state_dict)
    optional = _optional_keys(built) | _optional_keys(state_dict)
    absent = {k for k in set(template) - set(given) if k in optional}
    missing = set(template) - set(given) - absent
    extra = set(given) - set(template) - optional
    _raise_mismatch(missing, extra if strict else set())
    for key, dst in template.items():
        if key in absent:
            continue
        src = given[key]
        if tuple(src.shape) != tuple(dst.shape) or src.dtype != dst.dtype:
            raise ValueError(f"Checkpoint entry {key} is "
                             f"{tuple(src.shape)} {src.dtype}, this run's state has "
                             f"{tuple(dst.shape)} {dst.dtype}.")
    for key, dst in template.items():
        if key in absent:       # declared optional, not in the checkpoint: zeros ("absent")
            (dst.to_local() if is_dtensor(dst) else dst).zero_()
            continue
        src = given[key]
        if src is dst:
            continue
        d = dst.to_local() if is_dtensor(dst) else dst
        s = src.to_local() if is_dtensor(src) else src
        if d.data_ptr() != s.data_ptr() or d.numel() == 0:
            d.copy_(s)
    return state


def check_checkpoint(state_dict: Mapping[str, Any], metadata: Any, prefix: str = "",
                     group: Any = None) -> None:
    """Compare a whole DCP checkpoint with the whole run before ``dcp.load``: collective.

    Every rank's `state_dict` (of its freshly initialized state) names the entries it will
    read; the union over ``group`` must equal the checkpoint's entries under ``prefix``, with
    the same global shapes. A checkpoint of another chain or parameter set then fails with the
    first missing or unexpected entries, or a shape mismatch, named on every rank, instead of
    DCP's error on one rank (or a silent partial load).

    Give the checkpoint's directory and its metadata is read here without running code
    from it (`opttx.distributed.read_metadata`: an allowlist of DCP's metadata classes; a
    planted payload raises ``ValueError`` naming the file). ``dcp.FileSystemReader(path)
    .read_metadata()`` unpickles it with ``pickle``, which runs whatever the file names.

    Args:
      state_dict: this rank's `state_dict` of the template state.
      metadata: the checkpoint directory (a ``str`` or path), its ``Metadata``
        (`opttx.distributed.read_metadata`) or its ``state_dict_metadata``.
      prefix: where the optimizer state sits in the saved dict (``"optim"`` for
        ``{"optim": state_dict(...)}``).
      group: the ranks taking part (None: the default group, or this process alone when no
        process group is initialized).

    Raises:
      ValueError: on every rank, naming the mismatch.
    """
    if isinstance(metadata, (str, os.PathLike)):
        metadata = read_metadata(metadata)
    table = getattr(metadata, "state_dict_metadata", metadata)
    lead = f"{prefix}." if prefix else ""
    mine = {}
    for key, x in _flat(state_dict).items():
        mine[lead + key] = tuple(x.shape)
    stamps = {f"{lead}{MADE_BY}.{k}": v for k, v in (_made_by(state_dict) or {}).items()}
    everyone = [mine]
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
    expected: dict[str, tuple[int, ...]] = {}
    for table_r in everyone:
        expected.update(table_r)
    makers: dict[str, str] = dict(stamps)
    if dist.is_initialized():
        every_stamps: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(every_stamps, stamps, group=group)
        for table_r in every_stamps:
            makers.update(table_r)
    saved_makers = {k for k in table if k.startswith(f"{lead}{MADE_BY}.")}
    if saved_makers and saved_makers != set(makers):
        cut = len(lead + MADE_BY) + 1
        raise ValueError(
            f"check_checkpoint: the checkpoint's optimizer state was made by another "
            f"transform or configuration (made_by entries "
            f"{sorted(k[cut:] for k in saved_makers)[:3]} in the checkpoint, "
            f"{sorted(k[cut:] for k in makers)[:3]} in this run, which is "
            f"{'; '.join(sorted(set(makers.values())))[:600]}). load_checkpoint names both; "
            "build the transform that saved it.")
    saved = {k: tuple(getattr(v, "size", ())) for k, v in table.items()
             if k.startswith((lead + STATE + ".", lead + SHARED + "."))}
    # entries of fields declared optional may be absent on either side (load_checkpoint
    # zeroes this run's that the checkpoint lacks)
    missing = {k for k in set(expected) - set(saved) if not is_optional_entry(k[len(lead):])}
    extra = {k for k in set(saved) - set(expected) if not is_optional_entry(k[len(lead):])}
    per_rank = sorted({k.rsplit("@rank", 1)[1] for k in saved if "@rank" in k},
                      key=lambda r: int(r) if r.isdigit() else 0)
    if per_rank and (missing or extra):
        raise ValueError(
            f"The checkpoint does not match this run: it was saved per rank (per_rank=True; "
            f"entries of ranks {', '.join(per_rank)}, e.g. unexpected {_describe(extra)}), "
            "and such entries hold statistics of each rank's local shard, which reload only "
            "at the same world size and sharding. Resume at that world size, or save without "
            "per_rank (states that declare their layout, as every opttx transform does, "
            "reshard).")
    _raise_mismatch(missing, extra)
    for k, shape in sorted(expected.items()):
        if k in saved and saved[k] != shape:
            raise ValueError(f"Checkpoint entry {k} has shape {saved[k]}, this run's state "
                             f"has {shape}.")


def _fresh(tree: Any) -> Any:
    """A copy of the nested dicts/lists of ``tree`` with a new uninitialized buffer for every
    tensor (a DTensor keeps its mesh and placements) and other values as they are."""
    if isinstance(tree, Mapping):
        return {k: _fresh(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_fresh(v) for v in tree]
    if isinstance(tree, torch.Tensor):
        return torch.empty_like(tree)
    return tree


def _copy_back(live: Any, loaded: Any) -> None:
    """Write ``loaded`` (from `_fresh`, filled) into the tensors of ``live``; other values of
    dicts and lists are replaced, as ``dcp.load`` does."""
    items = live.items() if isinstance(live, Mapping) else enumerate(live)
    for k, dst in list(items):
        if isinstance(live, Mapping) and k not in loaded:
            continue                  # an optional entry the checkpoint lacks (_absent_optional)
        src = loaded[k]
        if isinstance(dst, torch.Tensor):
            d = dst.to_local() if is_dtensor(dst) else dst
            d.copy_(src.to_local() if is_dtensor(src) else src)
        elif isinstance(dst, (Mapping, list)):
            _copy_back(dst, src)
        else:
            live[k] = src


@torch.no_grad()
def load_checkpoint(state_dict: dict[str, Any], checkpoint_id: Any = None, *,
                    storage_reader: Any = None, planner: Any = None, group: Any = None) -> None:
    """``dcp.load`` that changes nothing unless the whole load succeeds on every rank.

    ``dcp.load(sd)`` writes each tensor of ``sd`` in place as it is read, so a load that fails
    part-way (a missing or truncated shard file, read by some ranks only) leaves half of the
    live parameters and optimizer state overwritten, on some ranks. Here the checkpoint is
    read into new buffers shaped like ``state_dict``'s tensors (one extra copy of the state in
    memory while loading), every rank agrees that its read succeeded (one all-reduce), and
    only then are the live tensors overwritten; otherwise every rank raises and nothing
    changed.

    Args:
      state_dict: nested dicts (and lists) of the live tensors to load, as for ``dcp.load``
        (``{"params": params, "optim": opttx.distributed.state_dict(state, params)}``).
      checkpoint_id, storage_reader, planner: as for ``torch.distributed.checkpoint.load``.
      group: the ranks loading together (None: the default group).

    A checkpoint directory saved by `save_checkpoint` is verified first against its
    checksums (`verify_checkpoint`: every file's size and SHA-256; ``torch``'s formats detect
    no flipped bit); any directory is refused if one of its files is empty.

    Nothing in the checkpoint runs code: its ``.metadata`` is read through an allowlist of
    the classes DCP's metadata is made of (`opttx.distributed.read_metadata`), and its
    non-tensor entries with ``torch.load(weights_only=True)`` (where DCP would unpickle both
    in full). A ``.metadata`` naming anything else, or no pickle at all, raises a
    ``ValueError`` naming the file on every rank before any tensor is read. A ``planner`` or
    a ``storage_reader`` of your own (other than a plain ``dcp.FileSystemReader``, which is
    replaced by the allowlisted one) reads the checkpoint its own way.

    Raises:
      ValueError: on every rank, naming a file that fails verification or a ``.metadata``
        that is not DCP's; on the other ranks, naming the rank whose read failed (that rank
        raises the read's own error). Nothing of ``state_dict`` was written.

    Example:
      >>> sd = {"params": params, "optim": state_dict(state, params)}
      >>> load_checkpoint(sd, checkpoint_id=path)
      >>> state = load_state_dict(state, sd["optim"], params)
    """
    import torch.distributed.checkpoint as dcp
    if checkpoint_id is not None and storage_reader is None:
        # the bits as saved (save_checkpoint's checksums, when present; no empty file)
        verify_checkpoint(checkpoint_id, group=group, required=False)
    # the metadata through the allowlist, and entries with weights_only (nothing runs code)
    reader = safe_reader(checkpoint_id, storage_reader)
    planner = SafeLoadPlanner() if planner is None else planner
    error = None
    saved = None
    try:       # the metadata (named errors), then what made the saved optimizer states,
        # against this run's, before any read
        saved = set(reader.read_metadata().state_dict_metadata) if reader is not None \
            else None
        _check_saved_makers(state_dict, saved, checkpoint_id, reader)
    except ValueError as e:
        error = e
    raise_on_every_rank(error, group, "load_checkpoint: rank {rank} refused the checkpoint "
                                      "(see its error); nothing was loaded.")
    fresh = _fresh(state_dict)
    absent = _absent_optional(state_dict, fresh, saved)
    try:
        dcp.load(fresh, checkpoint_id=checkpoint_id, storage_reader=reader,
                 planner=planner, process_group=group)
    except (Exception, dcp.api.CheckpointException) as e:  # noqa: BLE001 - re-raised here,
        error = unwrap_refusal(e)                             # agreed on by the others
        # (DCP's CheckpointException derives from BaseException)
    raise_on_every_rank(error, group, "load_checkpoint: rank {rank} failed to read the "
                                      "checkpoint (see its error); nothing was loaded.")
    _copy_back(state_dict, fresh)
    for x in absent:             # optional entries the checkpoint lacks: zeros (absent)
        (x.to_local() if is_dtensor(x) else x).zero_()


def _absent_optional(live: Any, fresh: Any, saved: set[str] | None
                     ) -> list[torch.Tensor]:
    """The entries of fields declared optional (`opttx.extend.declare_optional`) in the opttx state
    dicts of ``live`` that the checkpoint lacks (``saved``: its entries, from its metadata;
    None: unknown): taken out of ``fresh`` (``dcp.load`` would refuse them) and returned
    (``live``'s tensors, to zero once the load succeeded)."""
    tables = list(zip(_opttx_state_dicts(live), _opttx_state_dicts(fresh)))
    if saved is None or not any(_optional_keys(sd) for (_, sd), _ in tables):
        return []
    out = []
    for (prefix, sd), (_, fresh_sd) in tables:
        for where in (STATE, SHARED):
            items = ([(p, fields, fresh_sd[STATE][p]) for p, fields in sd[STATE].items()]
                     if where == STATE else [(None, sd[SHARED], fresh_sd[SHARED])])
            for p, fields, fresh_fields in items:
                for f in list(fields):
                    key = f"{prefix}{where}.{p}.{f}" if p is not None else f"{prefix}{where}.{f}"
                    if is_optional_entry(f) and key not in saved:
                        out.append(fields[f])
                        del fresh_fields[f]
    return out


def _opttx_state_dicts(tree: Any, prefix: str = "") -> Iterator[tuple[str, Mapping]]:
    """``(DCP key prefix, state dict)`` of every `state_dict` nested in ``tree``."""
    if isinstance(tree, Mapping):
        if STATE in tree and SHARED in tree:
            yield prefix, tree
            return
        for k, v in tree.items():
            yield from _opttx_state_dicts(v, f"{prefix}{k}.")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _opttx_state_dicts(v, f"{prefix}{i}.")


def _check_saved_makers(state_dict: Any, saved: set[str] | None, checkpoint_id: Any,
                        reader: Any) -> None:
    """Compare the ``made_by`` entries of the checkpoint (``saved``: its entries, from its
    metadata; None: unknown, nothing compared; their values read alone, through ``reader``,
    when they differ) with this run's, for every opttx state dict in ``state_dict``; raise
    naming both. Checkpoints saved without them pass."""
    import torch.distributed.checkpoint as dcp
    tables = list(_opttx_state_dicts(state_dict))
    if not tables or saved is None:
        return
    for prefix, sd in tables:
        lead = f"{prefix}{MADE_BY}."
        theirs = {k[len(lead):] for k in saved if k.startswith(lead)}
        mine = dict(sd.get(MADE_BY, {}))
        if not theirs or set(mine) <= theirs:
            continue
        values: dict[str, Any] = {k: "" for k in theirs}
        wanted: dict[str, Any] = {MADE_BY: values}
        for part in reversed(prefix.rstrip(".").split(".") if prefix else []):
            wanted = {part: wanted}
        dcp.load(wanted, checkpoint_id=checkpoint_id, storage_reader=reader,
                 planner=SafeLoadPlanner(), no_dist=True)
        _check_stamps(mine, values, "load_checkpoint")
