r"""The files of a checkpoint and their checksums: `save_checkpoint`, `verify_checkpoint`.

Neither ``torch.save`` nor ``torch.distributed.checkpoint`` (DCP) checks what it reads back:
a bit flipped on disk or in transit loads silently as another number (measured: a float32
500.0 loads as 500.00003 from both formats), and an emptied file fails deep inside torch
(``torch.load``: ``EOFError`` with an empty message; DCP: a ``CheckpointException`` wrapping
a traceback). `save_checkpoint` is ``dcp.save`` followed by a SHA-256 of every file of the
checkpoint, written next to them as ``.opttx-checksums.json``; `verify_checkpoint` recomputes
them and raises a ``ValueError`` naming the first file that differs, is missing or has
another size, on every rank. `opttx.distributed.load_checkpoint` verifies before it reads
when the checksums are there (and refuses a file of 0 bytes even without them).

The hashing is spread over the ranks (rank ``r`` hashes every ``W``-th file), so a save or a
load reads the checkpoint once more in all, split ``W`` ways; one ``all_gather_object`` and one
``broadcast_object_list`` carry the names and digests. The checkpoint must sit on a file
system every rank sees (as DCP's ``FileSystemWriter`` needs anyway).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

from .shapes import raise_on_every_rank

__all__ = ["CHECKSUMS", "save_checkpoint", "verify_checkpoint"]

CHECKSUMS = ".opttx-checksums.json"
"""The name of the checksum file inside a checkpoint directory."""

_CHUNK = 1 << 20


def _digest(path: Path) -> tuple[int, str]:
    """(size, SHA-256 hex digest) of a file, read in 1 MiB pieces."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
            size += len(block)
    return size, h.hexdigest()


def _distributed(group: Any) -> bool:
    return dist.is_initialized() and dist.get_world_size(group) > 1


def _from_first(value: Any, group: Any) -> Any:
    """``value`` as the group's first rank has it (one ``broadcast_object_list``)."""
    if not _distributed(group):
        return value
    box = [value]
    first = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(box, src=first, group=group)
    return box[0]


def _shared_digests(directory: Path, names: list[str], group: Any) -> dict[str, Any]:
    """``{name: (size, digest)}`` of the named files, each hashed by one rank; a file that
    cannot be read gives ``(None, reason)``."""
    rank = dist.get_rank(group) if _distributed(group) else 0
    world = dist.get_world_size(group) if _distributed(group) else 1
    mine: dict[str, Any] = {}
    for name in names[rank::world]:
        try:
            mine[name] = _digest(directory / name)
        except OSError as e:
            mine[name] = (None, f"{type(e).__name__}: {e}")
    if not _distributed(group):
        return mine
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine, group=group)
    return {k: v for part in every for k, v in part.items()}


def save_checkpoint(state_dict: dict[str, Any], checkpoint_id: str | os.PathLike, *,
                    planner: Any = None, group: Any = None) -> None:
    """``dcp.save`` into the directory ``checkpoint_id``, then write the SHA-256 of every file
    it holds to ``.opttx-checksums.json`` there (collective: every rank of ``group`` calls
    it). `opttx.distributed.load_checkpoint` and `verify_checkpoint` check them.

    The checksum file is written last, by the group's first rank, through a temporary file
    and an atomic rename: a checkpoint whose save was cut short has none (or the previous
    one, which then fails to verify), never a checksum file that vouches for missing data.

    Args:
      state_dict: nested dicts of the tensors to save, as for ``dcp.save``
        (``{"params": params, "optim": opttx.distributed.state_dict(state, params)}``).
      checkpoint_id: the checkpoint directory.
      planner: as for ``torch.distributed.checkpoint.save``.
      group: the ranks saving together (None: the default group, or this process alone).

    Example:
      >>> import tempfile
      >>> from opttx.distributed import load_checkpoint, state_dict
      >>> path = tempfile.mkdtemp()                        # a directory of your own
      >>> sd = {"params": params, "optim": state_dict(state, params)}
      >>> save_checkpoint(sd, path)
      >>> load_checkpoint(sd, checkpoint_id=path)          # verifies, then loads
    """
    import torch.distributed.checkpoint as dcp
    directory = Path(checkpoint_id)
    dcp.save(state_dict, checkpoint_id=str(directory), planner=planner, process_group=group)
    if _distributed(group):
        dist.barrier(group=group)
    names = _from_first(sorted(p.name for p in directory.iterdir()
                               if p.is_file() and p.name != CHECKSUMS
                               and not p.name.startswith(CHECKSUMS)), group)
    digests = _shared_digests(directory, names, group)
    error = None
    if not _distributed(group) or dist.get_rank(group) == 0:
        try:
            unreadable = [n for n, (size, _) in digests.items() if size is None]
            if unreadable:
                raise OSError(f"save_checkpoint: could not read back {unreadable[0]} "
                              f"({digests[unreadable[0]][1]}).")
            table = {"algorithm": "sha256",
                     "files": {n: {"size": s, "sha256": d} for n, (s, d) in digests.items()}}
            tmp = directory / (CHECKSUMS + ".tmp")
            tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
            os.replace(tmp, directory / CHECKSUMS)
        except OSError as e:
            error = e
    if _distributed(group):
        raise_on_every_rank(error, group, "save_checkpoint: rank {rank} could not write the "
                                          "checksums (see its error).")
    elif error is not None:
        raise error


def verify_checkpoint(checkpoint_id: str | os.PathLike, *, group: Any = None,
                      required: bool = True) -> bool:
    """Recompute the checksums `save_checkpoint` wrote and compare (collective).

    Args:
      checkpoint_id: the checkpoint directory.
      group: the ranks loading together (None: the default group, or this process alone).
      required: raise when the directory holds no checksum file (False: return False then,
        after refusing any file of 0 bytes, which no complete checkpoint has; and for a
        ``checkpoint_id`` that is not a local directory).

    Returns:
      True when the checksums were there and matched; False when there were none (and not
      ``required``).

    Raises:
      ValueError: on every rank, naming the first file whose size or SHA-256 differs from
        the saved one, that is missing, or (without checksums) that is empty.
    """
    directory = Path(checkpoint_id)
    table = None
    problem = None
    if not _distributed(group) or dist.get_rank(group) == 0:
        try:
            path = directory / CHECKSUMS
            if path.exists():
                table = json.loads(path.read_text())
                if table.get("algorithm") != "sha256" or not isinstance(table.get("files"),
                                                                        dict):
                    problem = f"{path} is not a checksum file of save_checkpoint."
            elif not directory.is_dir():
                if required:
                    problem = f"{directory} is not a checkpoint directory."
            else:
                empty = sorted(p.name for p in directory.iterdir()
                               if p.is_file() and p.stat().st_size == 0)
                if empty:
                    problem = (f"{directory / empty[0]} is empty (0 bytes): the checkpoint was "
                               "cut short or overwritten; load an earlier one.")
                elif required:
                    problem = (f"{directory} has no {CHECKSUMS}: it was not saved by "
                               "opttx.distributed.save_checkpoint, so nothing vouches for its "
                               "bits.")
        except (OSError, ValueError) as e:
            problem = f"could not read {directory / CHECKSUMS}: {type(e).__name__}: {e}"
    table, problem = _from_first((table, problem), group)
    if problem is not None:
        raise ValueError(f"verify_checkpoint: {problem}")
    if table is None:
        return False
    expected = table["files"]
    digests = _shared_digests(directory, sorted(expected), group)
    for name in sorted(expected):
        size, digest = digests[name]
        want = expected[name]
        if size is None:
            raise ValueError(f"verify_checkpoint: {directory / name} cannot be read ({digest}); "
                             "the checkpoint is incomplete.")
        if size != want["size"]:
            raise ValueError(f"verify_checkpoint: {directory / name} has {size} bytes, "
                             f"{want['size']} were saved: the file was cut short, emptied or "
                             "replaced after saving; load an earlier checkpoint.")
        if digest != want["sha256"]:
            raise ValueError(f"verify_checkpoint: {directory / name} does not have the SHA-256 "
                             "it was saved with: its bytes changed after saving (a flipped bit "
                             "on disk or in a copy); load an earlier checkpoint.")
    return True
