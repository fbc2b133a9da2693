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
- A pipeline run passes each rank's stage (build_stage's) as `model`: it is saved and loaded
  as `pipeline.global_view(stage)`, its parameters under the whole model's names, and the
  optimizer state keyed per parameter name (`flatten_optimizer_state_dict`), so the stages
  write one checkpoint of the whole model and each reads back its own names, under any split
  or world, or into the unsplit model (docs/integration.md, "Checkpoints of a pipeline
  run"; tests/test_pipeline_checkpoint.py).
- Layout: D/step-00000012/ holds DCP's files (.metadata, __<rank>_<i>.distcp) and
  dcp_opt.json (the manifest: step, world size, model tensor names / shapes / dtypes, the
  optimizer class, the loader state, extra, and every file's size and CRC32). D/latest names
  the newest complete checkpoint.
- Atomic: every rank writes into D/.tmp-step-00000012; rank 0 writes the manifest last,
  renames the folder, then replaces D/latest (os.replace). A save interrupted at any point
  leaves the previous checkpoint and D/latest as they were.
- One history per folder: steps only go up. A save below the folder's newest step is refused
  (a new run in a used folder, or a rollback), unless `new_history=True`: then the
  checkpoints above the new step (the abandoned history) are deleted once the new one is
  published. Pruning keeps the `keep` highest steps by number, never the folder `latest`
  names.
- Checked before anything is changed, with the same error on every rank: a missing or
  corrupted file (size / CRC32), another model (names, shapes, dtypes), another optimizer
  class, another dataset or batching (the loader's own check), names that leave the folder
  (`latest`, the manifest's files, symlinks), a manifest that lists no files.
- Trust: a checkpoint folder is code you trust. The CRCs catch damage, not an attacker who
  rewrites the manifest. Reading narrows what a crafted folder can do
  (runtime/checkpoint_safe.py): every torch.load is weights_only=True, and `.metadata`,
  which DCP would unpickle with plain pickle, is read allowing only DCP's metadata classes.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import distribute_tensor

from dcp_opt.errors import DcpOptError

from .checkpoint_folder import (
    MANIFEST,
    STEP_NAME,
    check_file_names,
    check_files,
    complete_steps,
    file_sums,
    history_error,
    prune,
    write_file,
)
from .checkpoint_safe import SafeLoadPlanner, SafeReader, metadata_error
from .wire import all_gather_json

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


def checkpointed(model):
    """(what to save or load for `model`, whether it is a pipeline stage). A stage of a
    pipeline run (build_stage's) is saved as `global_view(stage)`: its parameters under the
    whole model's names, so the stages together write one checkpoint of the model and each
    reads back its own names under any split (docs/integration.md, "Checkpoints of a
    pipeline run"). A model split by build_stage is refused: each rank updates only its own
    stage, so the rest of its copy is stale. Checked before any collective, alike on every
    rank; `_agree_on_stages` then checks that every rank passed a stage, or none."""
    from .pipeline.stages import PipelineStage, global_view, is_staged

    if isinstance(model, PipelineStage):
        return global_view(model), True
    if is_staged(model):
        raise DcpOptError(
            f"model: {type(model).__name__} split into pipeline stages by build_stage; its "
            "other stages' weights are stale on this rank; allowed: this rank's stage (what "
            "build_stage returned), or a model trained without a pipeline"
        )
    return model, False


def _agree_on_stages(staged: bool) -> None:
    """Every rank saves or loads a pipeline stage, or none does (a pipeline run gathers the
    tensor names of every stage: a rank that skipped that collective would leave the others
    waiting in it)."""
    if _rank_world()[1] > 1 and len(set(all_gather_json(staged))) > 1:
        raise DcpOptError(
            "model: a pipeline stage on some ranks and a whole model on others; allowed: "
            "every rank's stage (a pipeline run) or every rank's model"
        )


def save(
    directory,
    *,
    model,
    optimizer=None,
    loader=None,
    step: int,
    extra=None,
    keep: int = 2,
    new_history: bool = False,
) -> Path:
    """Write the training state after `step` steps to `directory`/step-<step> (collective:
    every rank calls it at the same point). `loader`: a DcpLoader, a DcpBatchSampler or a
    torch DataLoader whose batch_sampler is one; `extra`: JSON-serialisable. `keep`: the
    highest steps kept. A `step` below the folder's newest is refused unless `new_history`:
    then this save starts a new history and the checkpoints above `step` are deleted once it
    is published. A pipeline run passes each rank's stage as `model` (its optimizer over the
    stage's parameters). Returns the folder."""
    model, staged = checkpointed(model)
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise DcpOptError(f"step: {step!r} not allowed; allowed: an int >= 0")
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
        raise DcpOptError(f"keep: {keep!r} not allowed; allowed: an int >= 1")
    if not isinstance(new_history, bool):
        raise DcpOptError(f"new_history: {new_history!r} not allowed; allowed: True or False")
    stateful = None if loader is None else stateful_loader(loader)
    loader_state = None if stateful is None else stateful.state_dict()
    for what, value in (("extra", extra), ("loader state", loader_state)):
        try:
            json.dumps(value)
        except (TypeError, ValueError) as e:
            raise DcpOptError(f"{what}: not JSON-serialisable ({e})") from None
    root, name = Path(directory), f"step-{step:08d}"
    tmp, final = root / f".tmp-{name}", root / name
    _agree_on_stages(staged)
    _agree_on(f"checkpoint {root}", None if new_history else history_error(root, step))
    rank, world = _rank_world()
    fresh = optimizer is not None and not optimizer.state
    state = _state(model, optimizer, flat=staged)
    if fresh:  # get_state_dict made Adam-like state with a zero step: keep the run's own
        optimizer.state.clear()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was interrupted
        tmp.mkdir()
    _barrier()
    _whole_strided(state, template=False)
    with _one_process(world):
        dcp.save(state, checkpoint_id=str(tmp), no_dist=world == 1)
    _barrier()
    files = _gather(file_sums(tmp, rank, world))
    tensors = _tensors(state["model"])
    if staged:  # each rank holds its stage's names: the manifest lists the whole model's
        tensors = _gather(tensors)
    if rank == 0:
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "step": step,
            "world_size": world,
            "saved_unix_s": round(time.time(), 3),
            "model": tensors,
            "optimizer": None if optimizer is None else type(optimizer).__name__,
            "optimizer_state_empty": fresh,
            "optimizer_flat": staged,
            "loader": loader_state,
            "extra": extra,
            "files": files,
        }
        write_file(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
        _publish(root, tmp, final)
        prune(root, keep, final, drop_above=step if new_history else None)
    _barrier()
    return final


def load(directory, *, model, optimizer=None, loader=None, path=None) -> int:
    """Restore the newest complete checkpoint in `directory` (or the folder `path`) into
    `model`, `optimizer` and `loader`; returns the step it was saved at (the number of steps
    done). Collective. Any world size: the loader replans the epoch's remaining batches for
    its own cost model. Raises DcpOptError, with nothing changed, on a mismatch. A pipeline
    stage reads its own names only: any split, any world, or a checkpoint written without a
    pipeline."""
    model, staged = checkpointed(model)
    stateful = None if loader is None else stateful_loader(loader)
    info = read(path) if path is not None else latest(directory)
    if info is None:
        raise DcpOptError(
            f"checkpoint: no complete checkpoint in {directory} (no {Path(directory) / 'latest'}"
            " and no step-* folder with a manifest)"
        )
    where = f"checkpoint {info.path}"
    _agree_on_stages(staged)
    _agree_on(where, check_files(info.path, info.manifest, *_rank_world()))
    _agree_on(where, _check_model(info.manifest, model, optimizer, stage=staged))
    _agree_on(where, metadata_error(info.path))
    saved_loader = info.manifest["loader"]
    if stateful is not None and saved_loader is None:
        raise DcpOptError(f"{where}: holds no loader state; allowed: load(..., loader=None)")
    before = None if stateful is None else stateful.state_dict()
    try:
        if stateful is not None:
            stateful.load_state_dict(saved_loader)  # checks before it changes anything
        flat = info.manifest.get("optimizer_flat", False)
        state = _state(model, optimizer, flat=flat)
        strided = _whole_strided(state, template=True)
        world = _rank_world()[1]
        with _one_process(world):
            dcp.load(
                state,
                checkpoint_id=str(info.path),
                storage_reader=SafeReader(info.path),
                planner=SafeLoadPlanner(),
                no_dist=world == 1,
            )
        for parent, key, was in strided:  # each rank's blocks of the whole tensor read
            parent[key] = distribute_tensor(parent[key], was.device_mesh, was.placements,
                                            src_data_rank=None)  # fmt: skip
        if optimizer is None:
            set_model_state_dict(model, state["model"])
        else:
            set_state_dict(
                model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                options=StateDictOptions(flatten_optimizer_state_dict=flat),
            )  # fmt: skip
            if info.manifest["optimizer_state_empty"]:
                optimizer.state.clear()
    except Exception as e:
        if before is not None:
            stateful.load_state_dict(before)
        if isinstance(e, DcpOptError):
            raise DcpOptError(f"{where}: {e}") from None
        raise
    return info.step


def resume(directory, *, model, optimizer=None, loader=None) -> int:
    """The step a run starts from: the newest complete checkpoint in `directory` loaded
    (load()'s checks and return value), or 0 with nothing loaded when the folder holds none
    yet (the first run). Collective, like load."""
    if latest(directory) is None:
        return 0
    return load(directory, model=model, optimizer=optimizer, loader=loader)


def latest(directory) -> CheckpointInfo | None:
    """The newest complete checkpoint in `directory` (the folder D/latest names, else the
    highest complete step-* folder by step number), or None if there is none. `latest`
    must name a step-* folder of `directory`; anything else is refused."""
    root = Path(directory)
    pointer = root / "latest"
    if pointer.is_file():
        text = pointer.read_text().strip()
        if not STEP_NAME.fullmatch(text) or pointer.is_symlink():
            raise DcpOptError(
                f"checkpoint {root}: latest names {text!r}, not a step-* folder of {root}; "
                "allowed: a name written by checkpoint.save (step-<8 or more digits>)"
            )
        target = root / text
        if (target / MANIFEST).is_file():
            return read(target)
        dangling = text
    else:
        dangling = None
    done = complete_steps(root)
    if dangling is not None:  # never left by save; by a hand, or by dcp_opt before issue 29
        got = f"the highest complete step, {done[-1][1].name}" if done else "nothing"
        warnings.warn(
            f"checkpoint {root}: latest names {dangling}, which is not a complete "
            f"checkpoint; using {got}",
            stacklevel=2,
        )
    return read(done[-1][1]) if done else None


def read(path) -> CheckpointInfo:
    """The manifest of the checkpoint folder `path`, checked for its format and for file
    names that stay inside the folder."""
    path = Path(path)
    if path.is_symlink() and path.resolve().parent != path.parent.resolve():
        raise DcpOptError(
            f"checkpoint {path}: a link to {path.resolve()}, outside the checkpoint folder "
            f"{path.parent}; allowed: a folder written there by checkpoint.save"
        )
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
    check_file_names(path, manifest["files"])
    return CheckpointInfo(path, manifest)


def stateful_loader(loader):
    """What holds the loader state of `loader`: a DcpLoader or DcpBatchSampler itself, the
    DcpBatchSampler of a torch DataLoader built with batch_sampler=it, or any other object
    with state_dict() and load_state_dict(). Anything else is refused, naming what to pass."""
    from torch.utils.data import DataLoader

    from .data import DcpBatchSampler, DcpLoader

    if isinstance(loader, (DcpLoader, DcpBatchSampler)):
        return loader
    allowed = (
        "allowed: a DcpLoader, a DcpBatchSampler, or a DataLoader built with "
        "batch_sampler=DcpBatchSampler(...)"
    )
    if isinstance(loader, DataLoader):
        if isinstance(loader.batch_sampler, DcpBatchSampler):
            return loader.batch_sampler
        inner = type(loader.batch_sampler).__name__
        raise DcpOptError(
            f"loader: a {type(loader).__name__} whose batch_sampler is a {inner}, which holds "
            f"no dcp_opt loader state; {allowed}"
        )
    if callable(getattr(loader, "state_dict", None)) and callable(
        getattr(loader, "load_state_dict", None)
    ):
        return loader
    raise DcpOptError(f"loader: a {type(loader).__name__} has no state_dict(); {allowed}")


# ---- state dicts ----------------------------------------------------------------------------
def _state(model, optimizer, *, flat: bool = False) -> dict:
    """flat: the optimizer state keyed per parameter name (`state.<name>.<key>`,
    `param_groups.<name>.<key>`), as a pipeline run saves it: nested, its `param_groups`
    list is one object under one key, which DCP writes from one rank only, and the stages'
    groups differ (a stage that read another's groups lost its hyperparameters)."""
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    options = StateDictOptions(flatten_optimizer_state_dict=flat)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    return {"model": model_sd, "optim": optim_sd}


def _whole_strided(tree, *, template: bool) -> list:
    """Replace, in place, every DTensor of `tree` (nested dicts and lists) split in
    interleaved blocks (tensor_parallel.is_strided: TinyLM's fused qkv under TP) by its whole
    tensor (`template`: an empty one of its global shape, for DCP to read into): DCP cannot
    write such a split as a chunk (its offsets overlap: the first TP checkpoint test failed
    that way), and the whole tensor is what every layout reads. Returns (parent, key, the
    DTensor replaced) for each. The TP ranks of a unit hold the same whole tensor, which DCP
    writes once; it costs one such tensor's bytes per rank while saving."""
    from .tensor_parallel import is_strided

    out = []
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    for key, value in list(items):
        if isinstance(value, (dict, list)):
            out += _whole_strided(value, template=template)
        elif is_strided(value):
            whole = torch.empty(value.shape, dtype=value.dtype, device=value.to_local().device)
            tree[key] = whole if template else value.full_tensor()
            out.append((tree, key, value))
    return out


def _tensors(model_sd: dict) -> dict:
    """name -> global shape and dtype (a DTensor's .shape is its global shape)."""
    return {
        k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
        for k, v in model_sd.items()
        if isinstance(v, torch.Tensor)
    }


def _check_model(manifest: dict, model, optimizer, *, stage: bool = False) -> str | None:
    """stage: `model` is a pipeline stage's view, which reads its own names only (the
    checkpoint's other names are the other stages')."""
    saved, here = manifest["model"], _tensors(get_model_state_dict(model))
    missing = [] if stage else sorted(set(saved) - set(here))
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
    write_file(root / ".latest.tmp", final.name + "\n")
    os.replace(root / ".latest.tmp", root / "latest")


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
    return {k: v for p in all_gather_json(part) for k, v in p.items()}


def _agree_on(where: str, error: str | None) -> None:
    """Raise the first rank's error on every rank (each rank checked its share)."""
    if _rank_world()[1] > 1:
        error = next((e for e in all_gather_json(error) if e is not None), None)
    if error is not None:
        raise DcpOptError(f"{where}: {error}")
