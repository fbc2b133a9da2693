"""The checkpoint folder's files (runtime/checkpoint.py): step-* names ordered by number, the
one-history rule, manifest names kept inside the folder, sizes and CRC32s, pruning."""

from __future__ import annotations

import os
import re
import shutil
import zlib
from pathlib import Path

from dcp_opt.errors import DcpOptError

MANIFEST = "dcp_opt.json"
STEP_NAME = re.compile(r"step-(\d{8,})")  # f"step-{step:08d}": 8 digits or more


def complete_steps(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete step-* folder, by step number."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = STEP_NAME.fullmatch(p.name)
        if m and (p / MANIFEST).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def history_error(root: Path, step: int) -> str | None:
    """Refuse a save below the folder's newest step: it would go back in the history."""
    done = complete_steps(root)
    if not done or done[-1][0] <= step:
        return None
    newest = done[-1][0]
    return (
        f"step {step} is below step {newest}, the newest checkpoint here: a save must not go "
        "back in a folder's history (a new run in a used folder, or a rollback); allowed: a "
        f"step >= {newest}, another folder, or save(..., new_history=True) to start a new "
        f"history here, which deletes the checkpoints above step {step} once it is saved"
    )


def check_file_names(path: Path, files: dict) -> None:
    """Every entry a plain file name of `path` with its size and CRC32 (DCP's .metadata
    among them), and none that leads outside the folder (`..`, absolute, a symlink)."""
    if ".metadata" not in files:
        raise DcpOptError(
            f"checkpoint {path}: {MANIFEST} field 'files' lists {sorted(files)[:5]}, without "
            "DCP's .metadata; allowed: the files checkpoint.save wrote, each with its size "
            "and CRC32"
        )
    inside = path.resolve()
    for name, entry in files.items():
        plain = name not in ("", ".", "..") and "/" not in name and "\\" not in name
        if not plain or (path / name).resolve().parent != inside:
            raise DcpOptError(
                f"checkpoint {path}: the manifest names {name!r}, not a file of the checkpoint "
                "folder; allowed: plain names of files inside it"
            )
        if not (isinstance(entry, dict) and entry.keys() == {"bytes", "crc32"}):
            raise DcpOptError(
                f"checkpoint {path}: {MANIFEST} field 'files' entry {name!r} is {entry!r}; "
                "allowed: {'bytes': int, 'crc32': hex string}"
            )


def file_sums(folder: Path, rank: int, world: int) -> dict:
    """Size and CRC32 of this rank's share of the folder's files (every world-th name)."""
    names = sorted(p.name for p in folder.iterdir() if p.name != MANIFEST)
    return {n: file_sum(folder / n) for n in names[rank::world]}


def file_sum(path: Path) -> dict:
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return {"bytes": size, "crc32": f"{crc:08x}"}


def check_files(folder: Path, manifest: dict, rank: int, world: int) -> str | None:
    """The first of this rank's share of the manifest's files that is missing or differs."""
    names = sorted(manifest["files"])
    for name in names[rank::world]:
        want = manifest["files"][name]
        if not (folder / name).is_file():
            return f"file {name} is missing (the manifest lists {len(names)} files)"
        got = file_sum(folder / name)
        if got != want:
            return (
                f"file {name} is corrupted: {got['bytes']} bytes, crc32 {got['crc32']}; the "
                f"manifest says {want['bytes']} bytes, crc32 {want['crc32']}"
            )
    return None


def write_file(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def prune(root: Path, keep: int, current: Path, *, drop_above: int | None) -> None:
    """Keep the `keep` highest steps by number and always `current` (what D/latest names);
    with `drop_above` (a new history), first delete every checkpoint above that step."""
    done = complete_steps(root)
    if drop_above is not None:
        for s, p in done:
            if s > drop_above and p != current:
                shutil.rmtree(p, ignore_errors=True)
        done = [(s, p) for s, p in done if s <= drop_above]
    for _, p in done[:-keep]:
        if p != current:
            shutil.rmtree(p, ignore_errors=True)
