"""Reading a DCP checkpoint without running code from it.

``torch.distributed.checkpoint`` reads a checkpoint's ``.metadata`` with ``pickle.load`` and
every non-tensor entry with ``torch.load(weights_only=False)``: a planted ``.metadata`` file
(or entry) runs whatever code it names as soon as it is read, before anything could check
it. opttx's loaders (`load_checkpoint`, `check_checkpoint` given a path, `read_metadata`)
read both through allowlists instead:

* the metadata with `MetadataUnpickler`, which resolves only the classes DCP's metadata is
  made of (``torch.distributed.checkpoint.metadata``'s dataclasses and enum, the file
  system's ``_StorageInfo``, ``torch.Size``, torch dtypes and layouts, ``pathlib`` paths) and
  refuses any other global with a ``ValueError`` naming the file and the global, before it
  is called;
* non-tensor entries with ``torch.load(weights_only=True)`` (`SafeLoadPlanner`): strings,
  numbers, containers, tensors and the classes registered with
  ``torch.serialization.add_safe_globals``.

A ``.metadata`` that is not a pickle at all (garbage, truncated) raises a ``ValueError``
naming the file, not ``pickle``'s "invalid load key".
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch

__all__ = ["MetadataUnpickler", "SafeFileSystemReader", "SafeLoadPlanner", "UnsafeCheckpoint",
           "read_metadata", "safe_reader", "unwrap_refusal"]

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED: dict[str, frozenset[str]] = {
    # what DCP's Metadata is made of (torch/distributed/checkpoint/metadata.py)
    _DCP_METADATA: frozenset({"Metadata", "StorageMeta", "TensorProperties",
                              "TensorStorageMetadata", "BytesStorageMetadata",
                              "ChunkStorageMetadata", "MetadataIndex", "_MEM_FORMAT_ENCODING"}),
    # FileSystemWriter's storage_data values
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    # TensorProperties.layout: torch pickles a layout as _get_layout("torch.strided")
    "torch.serialization": frozenset({"_get_layout"}),
    "torch._utils": frozenset({"_get_layout"}),
    # StorageMeta.checkpoint_id
    "pathlib": frozenset({"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath",
                          "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset"}),
}


class UnsafeCheckpoint(ValueError):
    """A checkpoint file or entry refused by opttx's allowlists, or metadata that is no DCP
    metadata (a ``ValueError`` naming the file or entry)."""


def unwrap_refusal(error: BaseException) -> BaseException:
    """The `UnsafeCheckpoint` inside DCP's ``CheckpointException`` (which wraps what a
    reader or planner raised, with a traceback per rank), or ``error`` itself."""
    for failure in getattr(error, "failures", {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, UnsafeCheckpoint):
            return inner
    return error


class MetadataUnpickler(pickle.Unpickler):
    """A ``pickle.Unpickler`` that resolves only the globals a DCP ``.metadata`` holds
    (module docstring); any other raises ``pickle.UnpicklingError`` naming it, before it is
    looked up, so nothing it names is imported or called."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch":
            value = getattr(torch, name, None) if name.isidentifier() else None
            if name == "Size" or isinstance(value, (torch.dtype, torch.layout,
                                                     torch.memory_format)):
                return value
        elif name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"global {module}.{name} is not part of DCP checkpoint metadata")


def _load_metadata(stream: Any, where: str) -> Any:
    """Unpickle DCP metadata from ``stream`` through the allowlist; a ``ValueError`` naming
    ``where`` (the file) for anything else."""
    from torch.distributed.checkpoint.metadata import Metadata
    try:
        metadata = MetadataUnpickler(stream).load()
    except pickle.UnpicklingError as e:
        if "is not part of DCP checkpoint metadata" in str(e):
            raise UnsafeCheckpoint(
                f"{where}: refused to read this checkpoint metadata: it names the {e}, so "
                "unpickling it could run code (torch would have run it). opttx reads DCP "
                "metadata with an allowlist of the classes torch's metadata is made of; a "
                "file naming anything else was not written by torch.distributed.checkpoint. "
                "Do not load this checkpoint.") from None
        raise UnsafeCheckpoint(f"{where} is not DCP checkpoint metadata ({type(e).__name__}: {e}): "
                         "the file is damaged or was replaced; load an earlier "
                         "checkpoint.") from None
    except (EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            UnicodeDecodeError, RuntimeError, MemoryError) as e:
        raise UnsafeCheckpoint(f"{where} is not DCP checkpoint metadata ({type(e).__name__}: {e}): "
                         "the file is cut short, damaged or was replaced; load an earlier "
                         "checkpoint.") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpoint(f"{where} holds a {type(metadata).__name__}, not DCP checkpoint "
                         "Metadata: the file was replaced; load an earlier checkpoint.")
    return metadata


def read_metadata(checkpoint_id: str | os.PathLike) -> Any:
    """The ``Metadata`` of the DCP checkpoint directory ``checkpoint_id``, read without running
    code from it (`MetadataUnpickler`): what ``dcp.FileSystemReader(path).read_metadata()``
    returns, for `check_checkpoint` or your own inspection.

    Raises:
      ValueError: naming the file, when it names a global outside DCP's metadata classes (a
        planted payload: nothing of it ran) or is not a metadata pickle at all.
      FileNotFoundError: there is no ``.metadata`` file.

    Example:
      >>> import tempfile, torch.distributed.checkpoint as dcp
      >>> path = tempfile.mkdtemp()
      >>> dcp.save({"optim": opttx.distributed.state_dict(state, params)}, checkpoint_id=path)
      >>> metadata = read_metadata(path)          # nothing the file names is called
      >>> opttx.distributed.check_checkpoint(opttx.distributed.state_dict(state, params),
      ...                                    metadata, "optim")
    """
    return SafeFileSystemReader(checkpoint_id).read_metadata()


def _file_system_reader() -> type:
    import torch.distributed.checkpoint as dcp
    return dcp.FileSystemReader


class SafeFileSystemReader(_file_system_reader()):      # type: ignore[misc]
    """``dcp.FileSystemReader`` whose ``read_metadata`` unpickles through
    `MetadataUnpickler` (same result for a checkpoint torch wrote; a ``ValueError`` naming
    the file for anything else)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _load_metadata(stream, str(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _default_load_planner() -> type:
    from torch.distributed.checkpoint import DefaultLoadPlanner
    return DefaultLoadPlanner


def _reason(error: Exception) -> str:
    """The line of a weights_only refusal that names what was refused."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    named = [ln for ln in lines if "Unsupported global" in ln or "GLOBAL" in ln]
    return (named or lines or ["refused by weights_only"])[0].rstrip(".") + "."


class SafeLoadPlanner(_default_load_planner()):      # type: ignore[misc]
    """``dcp.DefaultLoadPlanner`` that reads non-tensor entries with
    ``torch.load(weights_only=True)`` (DCP's own planner uses ``weights_only=False``, which
    runs code a planted entry names); an entry weights_only refuses raises a ``ValueError``
    naming it."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpoint(
                f"the checkpoint entry {fqn!r} is a pickled object that torch.load("
                "weights_only=True) refuses, so reading it could run code: "
                f"{_reason(e)} Register its class with torch.serialization."
                "add_safe_globals if you trust it, or pass planner=torch.distributed."
                "checkpoint.DefaultLoadPlanner() (a full unpickle) for a checkpoint you "
                "trust.") from None
        if self.flatten_state_dict:
            from torch.distributed.checkpoint import default_planner
            default_planner.set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def safe_reader(checkpoint_id: Any, storage_reader: Any) -> Any:
    """The storage reader opttx's loaders use: a `SafeFileSystemReader` for a directory
    ``checkpoint_id`` (or in place of a plain ``dcp.FileSystemReader``), else the caller's
    own ``storage_reader`` (a custom reader reads its metadata its own way), else None."""
    import torch.distributed.checkpoint as dcp
    if storage_reader is None:
        return None if checkpoint_id is None else SafeFileSystemReader(checkpoint_id)
    if type(storage_reader) is dcp.FileSystemReader:
        return SafeFileSystemReader(storage_reader.path)
    return storage_reader
