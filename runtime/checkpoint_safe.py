"""Reading a checkpoint folder without running what it holds, as far as torch lets us
(runtime/checkpoint.py).

- Tensors: DCP reads them with torch.load(weights_only=True) already.
- Non-tensor items (optimizer param_groups, step counts): DCP's default planner reads them
  with torch.load(weights_only=False); `SafeLoadPlanner` reads them with weights_only=True.
- `.metadata`: DCP's FileSystemReader unpickles it with plain pickle (torch offers no safe
  mode for it); `SafeReader` unpickles it allowing only the classes DCP's metadata is made
  of (torch.distributed.checkpoint.metadata, its storage info, torch.Size, dtypes, layouts,
  paths), so a crafted `.metadata` that names os.system or any other callable is refused.

This narrows the trust boundary; it does not remove it (docs/integration.md): torch's own
loaders are still what reads the data, and DCP exchanges pickled plans between ranks.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta

from dcp_opt.errors import DcpOptError

# What DCP 2.13's .metadata references besides the classes of dcp_metadata and dtypes.
ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by name, from a fixed table
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == dcp_metadata.__name__:
            obj = getattr(dcp_metadata, name, None)
            if isinstance(obj, type) and obj.__module__ == module:
                return obj
        raise pickle.UnpicklingError(
            f"{module}.{name} is not a class of DCP's metadata (a crafted .metadata?)"
        )


def metadata_error(folder) -> str | None:
    """Why the folder's .metadata is refused (read as SafeReader reads it), or None. Run
    before DCP, which swallows its reader's errors and looks for per-rank metadata."""
    try:
        with open(Path(folder) / ".metadata", "rb") as f:
            _read(f)
    except (DcpOptError, OSError) as e:
        return str(e)
    return None


def _read(f) -> dcp_metadata.Metadata:
    try:
        metadata = _MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
        raise DcpOptError(f".metadata refused: {e}") from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise DcpOptError(
            f".metadata refused: it holds a {type(metadata).__name__}, not DCP's Metadata"
        )
    return metadata


class SafeReader(FileSystemReader):
    """FileSystemReader whose .metadata is read by an allowlist unpickler."""

    def read_metadata(self, *args, **kwargs):
        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank)  # as FileSystemReader.read_metadata (torch 2.13)
        with self.fs.create_stream(path, "rb") as f:
            metadata = _read(f)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, with its non-tensor items read by
    torch.load(weights_only=True) instead of weights_only=False."""

    def load_bytes(self, read_item, value) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:  # as DefaultLoadPlanner.load_bytes (torch 2.13)
            path = self.mappings[read_item.dest_index.fqn]
            set_element(self.original_state_dict, path, obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
