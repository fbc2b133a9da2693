"""The layout holds (issue 24): no import circle anywhere in dcp_opt/, solvers/ and runtime/
(imports inside functions count too), no private name crosses a file, and solvers/ stays a
registry with its concerns in sub-packages.

The graph is read from the source with `ast`, not by importing it, so a circle that only
a lazy import inside a function closes is found as well as one at module level."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {
    "dcp_opt": ROOT / "dcp_opt",
    "dcp_opt.solvers": ROOT / "solvers",
    "dcp_opt.runtime": ROOT / "runtime",
}

# Private names of other libraries that the runtime has to touch, each for a reason:
FOREIGN_PRIVATE = {
    "_attn_implementation",  # transformers: the attention backend a config asks for
    "_from_config",  # transformers: build a model from its config without weights
    "_get_fsdp_state",  # torch FSDP2: the unit's state, to reach its parameters' shards
    "_unsharded_param",  # torch FSDP2: the gathered parameter of an unsharded unit
    "_get_metadata_path",  # torch DCP's FileSystemReader: where .metadata is (checkpoint_safe)
    "_get_backend",  # torch ProcessGroup: the world group's backend, for its timeout
    "_timeout",  # torch ProcessGroup options: the timeout new groups inherit (runtime/groups)
    "_fsdp_param_group",  # torch FSDP2: the unit's parameters, for their unsharded views
    # torch FSDP2 under HSDP with the cross-domain all-reduce off: the unit's reduce-scattered
    # fp32 gradient shards, held until the closing micro-step all-reduces them
    "_partial_reduce_output",
    # torch DeviceMesh (2.13 has no public form): split the TP mesh's "dp" column into
    # ("replicate", "shard") in place, keeping the root FSDP2 joins with "tp" (HSDP + TP)
    "_unflatten",
    # torch's CPU flash-attention kernels (runtime/cp.py: the log-sum-exp they return)
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
}


def modules(packages: dict[str, Path]) -> dict[str, Path]:
    """Dotted module name -> source file, for every .py under each package folder."""
    out = {}
    for pkg, folder in packages.items():
        for f in sorted(folder.rglob("*.py")):
            parts = list(f.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([pkg, *parts])] = f
    return out


def _absolute(name: str | None, here: str, level: int, is_package: bool) -> str:
    if not level:
        return name or ""
    base = here.split(".") if is_package else here.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _owner(name: str, mods: dict) -> str | None:
    """The longest prefix of a dotted name that is one of our modules."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (anywhere in the file). `from pkg import x`
    counts as an import of pkg.x when that is a module, else of pkg; a package's own
    __init__ imported on the way to a submodule is not counted (Python runs it first, so it
    cannot close a circle that the submodule's own imports do not)."""
    out = {}
    for m, f in mods.items():
        tree = ast.parse(f.read_text(), str(f))
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(node.module, m, node.level, f.name == "__init__.py")
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.add(sub if sub in mods else base)
        out[m] = {o for t in targets if (o := _owner(t, mods)) and o != m}
    return out


def circles(packages: dict[str, Path]) -> list[list[str]]:
    """Every set of modules that import each other, directly or around a loop."""
    graph = nx.DiGraph()
    for m, targets in imports(modules(packages)).items():
        graph.add_node(m)
        graph.add_edges_from((m, t) for t in targets)
    return sorted(sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1)


def test_no_import_circle():
    found = circles(PACKAGES)
    assert not found, f"modules that import each other (directly or in a loop): {found}"


def test_a_planted_circle_is_found(tmp_path):
    # a imports b at the top, b imports a inside a function: still a circle
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import x\n    return x\n")
    (pkg / "c.py").write_text("import pkg.a\n")  # imports into the circle, not part of it
    assert circles({"pkg": pkg}) == [["pkg.a", "pkg.b"]]


def _defined(tree: ast.Module) -> set[str]:
    """Private names a file defines: functions, classes, assignments and annotations
    anywhere (module, class bodies, `self._x = ...`), and setattr's string names."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            out.add(node.attr)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "__setattr__":
            out |= {a.value for a in node.args if isinstance(a, ast.Constant)}
        elif isinstance(node, ast.arg):
            out.add(node.arg)
    return {n for n in out if isinstance(n, str)}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_crossings(packages: dict[str, Path]) -> list[str]:
    """`from ours import _x`, and `x._y` where this file does not define `_y` (a private
    name of another file of ours: a module's, a class's or an instance's)."""
    mods = modules(packages)
    found = []
    for m, f in mods.items():
        tree = ast.parse(f.read_text(), str(f))
        own = _defined(tree)
        for node in ast.walk(tree):
            where = f"{m}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.ImportFrom):
                base = _absolute(node.module, m, node.level, f.name == "__init__.py")
                if _owner(base, mods):
                    found += [f"{where} imports {a.name}" for a in node.names if _private(a.name)]
            elif (
                isinstance(node, ast.Attribute)
                and _private(node.attr)
                and node.attr not in own | FOREIGN_PRIVATE
            ):
                found.append(f"{where} reads {ast.unparse(node)}")
    return found


def test_no_private_name_crosses_a_file():
    found = private_crossings(PACKAGES)
    assert not found, "private names used outside the file that defines them:\n" + "\n".join(found)


def test_a_planted_private_crossing_is_found(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def _helper():\n    return 1\n\n\nclass C:\n    _memo = {}\n")
    (pkg / "b.py").write_text(
        "from pkg.a import _helper\nfrom pkg import a\n\n\ndef f(c):\n"
        "    return a._helper(), c._memo, c.public\n"
    )
    assert sorted(x.split(" ", 1)[1] for x in private_crossings({"pkg": pkg})) == [
        "imports _helper",
        "reads a._helper",
        "reads c._memo",
    ]


def test_solvers_is_a_registry_with_sub_packages():
    top = sorted(p.name for p in (ROOT / "solvers").glob("*.py"))
    assert len(top) <= 8, f"solvers/ has {len(top)} modules at its top level: {top}"
    subs = sorted(p.parent.name for p in (ROOT / "solvers").glob("*/__init__.py"))
    assert subs == ["baselines", "bounds", "cpsat", "greedy", "pipeline", "stream"]
