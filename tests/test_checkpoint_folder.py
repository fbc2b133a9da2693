"""The checkpoint folder never loses the newest save (issue 29): pruning orders by step
number and never deletes what `latest` names, a save below the folder's newest step is
refused unless the run says it starts a new history, names from `latest` and the manifest
stay inside the folder, a manifest with no files is refused, non-tensor state is unpickled
with torch's safe loader and `.metadata` with an allowlist, and `loader=` takes what a user
naturally passes (issue 28 item 4).

One process, no torch.distributed: the folder logic is rank 0's alone."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import pytest
import torch
from dcp_opt.runtime import checkpoint
from dcp_opt.runtime.checkpoint_folder import file_sum
from torch.utils.data import DataLoader

from dcp_opt import DcpOptError
from tests.test_checkpoint import DATA, build

# Short samples: every one fits a single rank, so a one-process loader plans them all.
SHORT = [5, 3, 9, 2, 12, 7, 4, 6, 11, 10, 8, 3, 5, 2]


def names(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def old_run(folder, steps=(95, 100), *, keep=2):
    """A finished run's checkpoints in `folder` (seed 0 weights)."""
    model, opt, loader, _ = build(1)
    for s in steps:
        checkpoint.save(folder, model=model, optimizer=opt, loader=loader, step=s, keep=keep)
    return model, opt, loader


# ---- a save never deletes the newest checkpoint -----------------------------------------------
def test_a_new_run_in_a_used_folder_is_refused_and_changes_nothing(tmp_path):
    old_run(tmp_path)
    before = names(tmp_path)
    model, opt, loader, _ = build(1, init_seed=1)  # a new run: other weights, step 5
    with pytest.raises(DcpOptError, match=r"step 5 is below step 100.*new_history=True"):
        checkpoint.save(tmp_path, model=model, optimizer=opt, loader=loader, step=5, keep=2)
    # Today's code wrote step 5, pointed latest at it, then pruned it (sorted by name).
    assert names(tmp_path) == before == ["latest", "step-00000095", "step-00000100"]
    assert checkpoint.latest(tmp_path).step == 100


def test_a_new_history_keeps_the_new_save_and_drops_the_later_steps(tmp_path):
    old_run(tmp_path)
    model, opt, loader, _ = build(1, init_seed=1)
    want = params(model)
    kw = dict(model=model, optimizer=opt, loader=loader)
    checkpoint.save(tmp_path, step=5, keep=2, new_history=True, **kw)
    assert names(tmp_path) == ["latest", "step-00000005"]  # 95 and 100: the old history
    assert (tmp_path / "latest").read_text().strip() == "step-00000005"
    fresh = build(1, init_seed=2)[0]
    assert checkpoint.load(tmp_path, model=fresh) == 5
    assert all(torch.equal(a, b) for a, b in zip(params(fresh), want, strict=True))


def test_a_rollback_keeps_its_save_loadable(tmp_path):
    old_run(tmp_path)
    model, opt, loader, _ = build(1, init_seed=1)
    kw = dict(model=model, optimizer=opt, loader=loader)
    assert checkpoint.load(tmp_path, path=tmp_path / "step-00000095", **kw) == 95
    with torch.no_grad():  # "train": the state after step 96 differs from both saved ones
        for p in model.parameters():
            p.add_(0.25)
    want = params(model)
    with pytest.raises(DcpOptError, match="step 96 is below step 100"):
        checkpoint.save(tmp_path, step=96, keep=1, **kw)
    assert checkpoint.latest(tmp_path).step == 100
    checkpoint.save(tmp_path, step=96, keep=1, new_history=True, **kw)
    # Today's code deleted step 96 (keep=1, by name) and the next load resumed step 100.
    assert names(tmp_path) == ["latest", "step-00000096"]
    fresh = build(1, init_seed=2)[0]
    assert checkpoint.load(tmp_path, model=fresh) == 96
    assert all(torch.equal(a, b) for a, b in zip(params(fresh), want, strict=True))


def test_pruning_orders_by_step_number_past_eight_digits(tmp_path):
    old_run(tmp_path, steps=(99_999_999, 100_000_000), keep=1)
    # By name "step-100000000" < "step-99999999": today's code pruned the newest.
    assert names(tmp_path) == ["latest", "step-100000000"]
    assert checkpoint.latest(tmp_path).step == 100_000_000
    (tmp_path / "latest").unlink()  # without the pointer: the highest step by number
    shutil.copytree(tmp_path / "step-100000000", tmp_path / "step-99999999")
    info = checkpoint.latest(tmp_path)
    assert info.path.name == "step-100000000"


def test_a_dangling_latest_is_said(tmp_path):
    # What the old code left after a new run's save(step=5, keep=2) beside 95 and 100.
    old_run(tmp_path)
    (tmp_path / "latest").write_text("step-00000005\n")
    with pytest.warns(UserWarning, match="latest names step-00000005, which is not a complete"):
        assert checkpoint.latest(tmp_path).step == 100


def test_the_same_step_saved_again_replaces_it(tmp_path):
    model, opt, loader = old_run(tmp_path, steps=(3,))
    checkpoint.save(tmp_path, model=model, optimizer=opt, loader=loader, step=3, extra={"b": 2})
    assert names(tmp_path) == ["latest", "step-00000003"]
    assert checkpoint.latest(tmp_path).extra == {"b": 2}


def test_new_history_must_be_a_bool(tmp_path):
    model, opt, loader, _ = build(1)
    with pytest.raises(DcpOptError, match="new_history: 'yes' not allowed; allowed: True or"):
        checkpoint.save(tmp_path, model=model, step=1, new_history="yes")
    assert not tmp_path.joinpath("latest").exists()


# ---- names stay inside the folder ----------------------------------------------------------------
@pytest.mark.parametrize("pointer", ["../elsewhere", "ABS", "step-00000001/../../elsewhere"])
def test_latest_naming_a_folder_outside_is_refused(tmp_path, pointer):
    root = tmp_path / "ckpt"
    old_run(root, steps=(1,))
    shutil.copytree(root / "step-00000001", tmp_path / "elsewhere")  # a complete checkpoint
    text = str(tmp_path / "elsewhere") if pointer == "ABS" else pointer
    (root / "latest").write_text(text + "\n")
    model = build(1)[0]
    with pytest.raises(DcpOptError, match=r"latest names .* not a step-\* folder of"):
        checkpoint.load(root, model=model)
    with pytest.raises(DcpOptError, match="latest names"):
        checkpoint.latest(root)


def test_a_step_folder_linked_outside_is_refused(tmp_path):
    root = tmp_path / "ckpt"
    old_run(root, steps=(1,))
    shutil.move(root / "step-00000001", tmp_path / "elsewhere")
    (root / "step-00000001").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(DcpOptError, match="outside the checkpoint folder"):
        checkpoint.load(root, model=build(1)[0])


def rewrite_manifest(folder, change):
    path = folder / checkpoint.MANIFEST
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("name", ["../../outside.txt", "ABS", "sub/../.metadata"])
def test_manifest_names_outside_the_folder_are_refused(tmp_path, name):
    root = tmp_path / "ckpt"
    old_run(root, steps=(1,))
    (tmp_path / "outside.txt").write_text("x")
    name = str(tmp_path / "outside.txt") if name == "ABS" else name
    # the outside file's true size and CRC32: today's check reported it as fine
    entry = {"bytes": 1, "crc32": "8cdc1683"}
    rewrite_manifest(root / "step-00000001", lambda m: m["files"].update({name: entry}))
    with pytest.raises(DcpOptError, match=r"manifest names .* not a file of the checkpoint"):
        checkpoint.load(root, model=build(1)[0])


def test_a_manifest_file_linked_outside_is_refused(tmp_path):
    root = tmp_path / "ckpt"
    old_run(root, steps=(1,))
    folder = root / "step-00000001"
    shard = next(p for p in folder.iterdir() if p.suffix == ".distcp")
    shutil.move(shard, tmp_path / "shard")
    shard.symlink_to(tmp_path / "shard")  # same bytes, same CRC: only the place is wrong
    with pytest.raises(DcpOptError, match="not a file of the checkpoint folder"):
        checkpoint.load(root, model=build(1)[0])


@pytest.mark.parametrize("files", [{}, "missing", {".metadata": {"bytes": 1}}])
def test_a_manifest_without_files_is_refused(tmp_path, files):
    root = tmp_path / "ckpt"
    old_run(root, steps=(1,))

    def change(m):
        if files == "missing":
            del m["files"]
        else:
            m["files"] = files

    rewrite_manifest(root / "step-00000001", change)
    with pytest.raises(DcpOptError, match=r"field 'files'"):
        checkpoint.load(root, model=build(1)[0])


# ---- safe loading ---------------------------------------------------------------------------------
def test_every_torch_load_of_a_checkpoint_is_weights_only(tmp_path, monkeypatch):
    model, opt, loader, _ = build(1)
    model(torch.arange(3), torch.arange(3), torch.zeros(3, dtype=torch.long)).sum().backward()
    opt.step()  # an optimizer state with non-tensor entries (param_groups, step counts)
    checkpoint.save(tmp_path, model=model, optimizer=opt, loader=loader, step=1)
    seen, real = [], torch.load

    def recording(*a, **k):
        seen.append(k.get("weights_only"))
        return real(*a, **k)

    monkeypatch.setattr(torch, "load", recording)
    m, o, ld, _ = build(1, init_seed=3)
    assert checkpoint.load(tmp_path, model=m, optimizer=o, loader=ld) == 1
    assert seen and all(w is True for w in seen), seen  # torch's own planner passed False
    assert o.state_dict()["param_groups"] == opt.state_dict()["param_groups"]


class Crafted:
    """Unpickles to os.system(...): what the issue's crafted .metadata ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_crafted_metadata_is_refused_and_runs_nothing(tmp_path):
    root = tmp_path / "ckpt"
    old_run(root, steps=(1,))
    folder, marker = root / "step-00000001", tmp_path / "ran"
    (folder / ".metadata").write_bytes(pickle.dumps(Crafted(marker)))
    # the manifest rewritten to match, as the attack did: the CRCs cannot tell
    rewrite_manifest(
        folder, lambda m: m["files"].update({".metadata": file_sum(folder / ".metadata")})
    )
    with pytest.raises(DcpOptError, match=r"\.metadata refused: posix\.system is not a class"):
        checkpoint.load(root, model=build(1)[0])
    assert not marker.exists()  # today's code ran the command


# ---- loader= takes what a user passes -------------------------------------------------------------
def test_a_dataloader_over_the_sampler_is_accepted(tmp_path):
    from dcp_opt.runtime.data import collate_samples

    model, opt, dcp_loader, _ = build(1, lengths=SHORT)
    sampler = dcp_loader.sampler
    dl = DataLoader(DATA, batch_sampler=sampler, collate_fn=collate_samples)
    next(iter(sampler.planned(dl)))  # one batch handed to the loop
    checkpoint.save(tmp_path, model=model, optimizer=opt, loader=dl, step=1)
    assert checkpoint.latest(tmp_path).manifest["loader"]["batches_done"] == 1
    other = build(1, lengths=SHORT)[2].sampler
    dl2 = DataLoader(DATA, batch_sampler=other, collate_fn=collate_samples)
    assert checkpoint.load(tmp_path, model=model, loader=dl2) == 1
    assert other.state_dict() == sampler.state_dict()
    assert checkpoint.load(tmp_path, model=model, loader=build(1, lengths=SHORT)[2].sampler) == 1


@pytest.mark.parametrize("kind", ["plain", "sampler", "object"])
def test_a_loader_without_our_state_is_refused_before_anything_is_written(tmp_path, kind):
    model, opt, dcp_loader, _ = build(1)
    bad = {
        "plain": DataLoader(list(range(14)), batch_size=4),
        "sampler": dcp_loader.sampler.__iter__(),  # a generator, not the sampler
        "object": object(),
    }[kind]
    where = tmp_path / "ckpt"
    want = r"loader: .*; allowed: a DcpLoader, a DcpBatchSampler, or a DataLoader"
    with pytest.raises(DcpOptError, match=want):
        checkpoint.save(where, model=model, optimizer=opt, loader=bad, step=1)
    assert not where.exists()  # today: AttributeError after DCP had written the shards
    old_run(where, steps=(1,))
    with pytest.raises(DcpOptError, match=want):
        checkpoint.load(where, model=model, loader=bad)
    if kind == "plain":
        with pytest.raises(DcpOptError, match="batch_sampler is a BatchSampler"):
            checkpoint.load(where, model=model, loader=bad)
