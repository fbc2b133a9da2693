"""Checkpoint and resume the whole training state with torch.distributed.checkpoint (DCP).

    path = checkpoint.save(D, model=model, optimizer=opt, loader=loader, step=step)  # collective
    step = checkpoint.load(D, model=model, optimizer=opt, loader=loader)  # collective: next step

- What is saved: the model and optimizer state as `get_state_dict` of
  torch.distributed.checkpoint.state_dict gives it (parameter names, each tensor as this run
  holds it: a plain replica is written once and read by every rank of any world size; DTensor /
  FSDP shards are resharded by DCP on load), the loader's `state_dict()` (epoch, batches done,
  shuffle seed, a fingerprint of the epoch's batches), the step, and a JSON `extra`. Nothing
  else drives a plan or a step: batches are a function of (seed, epoch); task randomness is
  seeded by (step, sequence id) (tasks.seeded_generator); planners are deterministic given
  their options, and a plan never changes the gradient.
- Layout: D/step-00000012/ holds DCP's files (.metadata, __<rank>_<i>.distcp) and
  dcp_opt.json (the manifest: step, world size, model tensor names / shapes / dtypes, the
  optimizer class, the loader state, extra, and every file's size and CRC32). D/latest names
  the newest complete checkpoint.
- Atomic: every rank writes into D/.tmp-step-00000012; rank 0 writes the manifest last,
  renames the folder, then replaces D/latest (os.replace). A save interrupted at any point
  leaves the previous checkpoint and D/latest as they were; `keep` checkpoints are kept.
- Checked before anything is changed, with the same error on every rank: a missing or
  corrupted file (size / CRC32), another model (names, shapes, dtypes), another optimizer
  class, another dataset or batching (the loader's own check).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from dcp_opt.errors import DcpOptError

MANIFEST = "dcp_opt.json"
FORMAT = "dcp_opt.checkpoint"
VERSION = 1


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint: its folder and manifest (step, world_size, extra, ...)."""

    path: Path
    manifest: dict

    @property
    def step(self) -> int:
        return self.manifest["step"]

    @property
    def world_size(self) -> int:
        return self.manifest["world_size"]

    @property
    def extra(self):
        return self.manifest["extra"]


def save(
    directory, *, model, optimizer=None, loader=None, step: int, extra=None, keep: int = 2
) -> Path:
    """Write the training state after `step` steps to `directory`/step-<step> (collective:
    every rank calls it at the same point). `loader`: anything with state_dict(), e.g.
    DcpLoader or DcpBatchSampler; `extra`: JSON-serialisable. Returns the folder."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise DcpOptError(f"step: {step!r} not allowed; allowed: an int >= 0")
    if not isinstance(keep, int) or keep < 1:
        raise DcpOptError(f"keep: {keep!r} not allowed; allowed: an int >= 1")
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as e:
        raise DcpOptError(f"extra: not JSON-serialisable ({e})") from None
    root, name = Path(directory), f"step-{step:08d}"
    tmp, final = root / f".tmp-{name}", root / name
    rank, world = _rank_world()
    fresh = optimizer is not None and not optimizer.state
    state = _state(model, optimizer)
    if fresh:  # get_state_dict made Adam-like state with a zero step: keep the run's own
        optimizer.state.clear()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was interrupted
        tmp.mkdir()
    _barrier()
    with _one_process(world):
        dcp.save(state, checkpoint_id=str(tmp), no_dist=world == 1)
    _barrier()
    files = _gather(_file_sums(tmp, rank, world))
    if rank == 0:
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "step": step,
            "world_size": world,
            "saved_unix_s": round(time.time(), 3),
            "model": _tensors(state["model"]),
            "optimizer": None if optimizer is None else type(optimizer).__name__,
            "optimizer_state_empty": fresh,
            "loader": None if loader is None else loader.state_dict(),
            "extra": extra,
            "files": files,
        }
        _write_file(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
        _publish(root, tmp, final)
        _prune(root, keep)
    _barrier()
    return final


def load(directory, *, model, optimizer=None, loader=None, path=None) -> int:
    """Restore the newest complete checkpoint in `directory` (or the folder `path`) into
    `model`, `optimizer` and `loader`; returns the step it was saved at (the number of steps
    done). Collective. Any world size: the loader replans the epoch's remaining batches for
    its own cost model. Raises DcpOptError, with nothing changed, on a mismatch."""
    info = read(path) if path is not None else latest(directory)
    if info is None:
        raise DcpOptError(
            f"checkpoint: no complete checkpoint in {directory} (no {Path(directory) / 'latest'}"
            " and no step-* folder with a manifest)"
        )
    where = f"checkpoint {info.path}"
    _agree_on(where, _check_files(info.path, info.manifest))
    _agree_on(where, _check_model(info.manifest, model, optimizer))
    saved_loader = info.manifest["loader"]
    if loader is not None and saved_loader is None:
        raise DcpOptError(f"{where}: holds no loader state; allowed: load(..., loader=None)")
    before = None if loader is None else loader.state_dict()
    try:
        if loader is not None:
            loader.load_state_dict(saved_loader)  # checks before it changes anything
        state = _state(model, optimizer)
        world = _rank_world()[1]
        with _one_process(world):
            dcp.load(state, checkpoint_id=str(info.path), no_dist=world == 1)
        if optimizer is None:
            set_model_state_dict(model, state["model"])
        else:
            set_state_dict(
                model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
            )
            if info.manifest["optimizer_state_empty"]:
                optimizer.state.clear()
    except Exception as e:
        if before is not None:
            loader.load_state_dict(before)
        if isinstance(e, DcpOptError):
            raise DcpOptError(f"{where}: {e}") from None
        raise
    return info.step


def latest(directory) -> CheckpointInfo | None:
    """The newest complete checkpoint in `directory` (D/latest, else the highest complete
    step-* folder), or None if there is none."""
    root = Path(directory)
    pointer = root / "latest"
    if pointer.is_file():
        target = root / pointer.read_text().strip()
        if (target / MANIFEST).is_file():
            return read(target)
    done = sorted(p for p in root.glob("step-*") if (p / MANIFEST).is_file())
    return read(done[-1]) if done else None


def read(path) -> CheckpointInfo:
    """The manifest of the checkpoint folder `path`, checked for its format."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise DcpOptError(f"checkpoint {path}: no {MANIFEST} (not a complete checkpoint)") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise DcpOptError(f"checkpoint {path}: {MANIFEST} is not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DcpOptError(f"checkpoint {path}: {MANIFEST} is not a {FORMAT} manifest")
    if manifest.get("version") != VERSION:
        raise DcpOptError(
            f"checkpoint {path}: version {manifest.get('version')!r}; allowed: {VERSION}"
        )
    kinds = {"step": int, "world_size": int, "model": dict, "files": dict,
             "optimizer_state_empty": bool}  # fmt: skip
    for key, kind in kinds.items():
        if not isinstance(manifest.get(key), kind):
            raise DcpOptError(
                f"checkpoint {path}: {MANIFEST} field {key!r} is {manifest.get(key)!r}; "
                f"allowed: {kind.__name__}"
            )
    return CheckpointInfo(path, manifest)


# ---- state dicts ----------------------------------------------------------------------------
def _state(model, optimizer) -> dict:
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _tensors(model_sd: dict) -> dict:
    """name -> global shape and dtype (a DTensor's .shape is its global shape)."""
    return {
        k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
        for k, v in model_sd.items()
        if isinstance(v, torch.Tensor)
    }


def _check_model(manifest: dict, model, optimizer) -> str | None:
    saved, here = manifest["model"], _tensors(get_model_state_dict(model))
    missing = sorted(set(saved) - set(here))
    unknown = sorted(set(here) - set(saved))
    differ = [
        f"{k}: {tuple(saved[k]['shape'])} {saved[k]['dtype']} in the checkpoint, "
        f"{tuple(here[k]['shape'])} {here[k]['dtype']} here"
        for k in sorted(set(saved) & set(here))
        if saved[k] != here[k]
    ]
    parts = []
    if missing:
        parts.append(f"not in this model: {missing[:5]}")
    if unknown:
        parts.append(f"not in the checkpoint: {unknown[:5]}")
    if differ:
        parts.append("; ".join(differ[:5]))
    if parts:
        return "another model (" + "; ".join(parts) + ")"
    # optimizer=None loads the model alone (evaluation, fine-tuning with a new optimizer).
    want = None if optimizer is None else type(optimizer).__name__
    if want is not None and manifest["optimizer"] != want:
        return f"optimizer: {manifest['optimizer']} in the checkpoint, {want} here"
    return None


# ---- files ----------------------------------------------------------------------------------
def _file_sums(folder: Path, rank: int, world: int) -> dict:
    """Size and CRC32 of this rank's share of the folder's files (every world-th name)."""
    names = sorted(p.name for p in folder.iterdir() if p.name != MANIFEST)
    return {n: _sum(folder / n) for n in names[rank::world]}


def _sum(path: Path) -> dict:
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return {"bytes": size, "crc32": f"{crc:08x}"}


def _check_files(folder: Path, manifest: dict) -> str | None:
    rank, world = _rank_world()
    names = sorted(manifest["files"])
    for name in names[rank::world]:
        want = manifest["files"][name]
        if not (folder / name).is_file():
            return f"file {name} is missing (the manifest lists {len(names)} files)"
        got = _sum(folder / name)
        if got != want:
            return (
                f"file {name} is corrupted: {got['bytes']} bytes, crc32 {got['crc32']}; the "
                f"manifest says {want['bytes']} bytes, crc32 {want['crc32']}"
            )
    return None


def _write_file(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _publish(root: Path, tmp: Path, final: Path) -> None:
    """Make the finished folder the checkpoint, then point D/latest at it."""
    if final.exists():  # the same step saved again: the new copy is complete, swap it in
        old = root / f".old-{final.name}"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _write_file(root / ".latest.tmp", final.name + "\n")
    os.replace(root / ".latest.tmp", root / "latest")


def _prune(root: Path, keep: int) -> None:
    done = sorted(p for p in root.glob("step-*") if (p / MANIFEST).is_file())
    for p in done[:-keep]:
        shutil.rmtree(p, ignore_errors=True)


# ---- collectives (none when torch.distributed is not initialised) ---------------------------
def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@contextlib.contextmanager
def _one_process(world: int):
    """Silence DCP's warning that it assumes one process: without torch.distributed, or in a
    world of 1, that is what is meant."""
    with warnings.catch_warnings():
        if world == 1:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _barrier() -> None:
    if _rank_world()[1] > 1:
        dist.barrier()


def _gather(part: dict) -> dict:
    if _rank_world()[1] == 1:
        return part
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, part)
    return {k: v for p in parts for k, v in p.items()}


def _agree_on(where: str, error: str | None) -> None:
    """Raise the first rank's error on every rank (each rank checked its share)."""
    if _rank_world()[1] > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, error)
        error = next((e for e in every if e is not None), None)
    if error is not None:
        raise DcpOptError(f"{where}: {error}")
