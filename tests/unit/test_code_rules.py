"""Static rules over the source tree, checked with ``ast`` (nothing is imported or executed).

- torch is imported only by torchpass/ (and examples/, an ordinary user script; bench/, whose scripts run real
  training; tests/ may test either);
- dependency direction: linkpass depends on no other Clockwork package, clockworkd not on slurm_hooks
  or torchpass (every import counts, including ones inside functions), and torchpass only on clockworkd's
  torch-free client-side modules (TORCHPASS_MAY_IMPORT);
- no import cycles among clockworkd.*, slurm_hooks.*, linkpass.*, torchpass.*;
- no module named utils.py;
- torch's private API (``torch._C``, c10d's ``_world``, ``_abort_process_group``, ``_get_default_group``, a mesh's
  ``_pg_registry``, ``DeviceMesh(_init_backend=...)``, FSDP2's parameter groups) is used only in
  torchpass/torch_compat.py, which checks the torch release it was tested with;
- every module has a docstring, package markers included.
"""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "clockworkd": ROOT / "daemon" / "clockworkd",
    "slurm_hooks": ROOT / "slurm_hooks",
    "linkpass": ROOT / "linkpass",
    "torchpass": ROOT / "torchpass",
}
SKIP_DIRS = {"build", "dist", "__pycache__", "node_modules"}
TORCH_ALLOWED = {"torchpass", "examples", "bench", "tests"}


def _source_files(base: Path = ROOT) -> Iterator[Path]:
    """Every .py file under ``base``, without virtualenvs, caches, build outputs and hidden folders."""
    found = []
    for folder, dirs, files in os.walk(base):
        dirs[:] = [d for d in dirs if not (d.startswith(".") or d in SKIP_DIRS or d.endswith(".egg-info"))]
        found += [Path(folder) / f for f in files if f.endswith(".py")]
    yield from sorted(found)


def _module_name(path: Path) -> tuple[str, bool]:
    """Dotted module name of a file inside one of PACKAGES, and whether it is a package ``__init__``."""
    for top, base in PACKAGES.items():
        if path.is_relative_to(base):
            parts = [top, *path.relative_to(base).with_suffix("").parts]
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            return ".".join(parts), is_package
    raise ValueError(f"{path} is not inside a Clockwork package")


def _project_modules() -> dict[str, Path]:
    modules = {}
    for base in PACKAGES.values():
        for path in _source_files(base):
            modules[_module_name(path)[0]] = path
    return modules


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _imported_names(tree: ast.Module, module: str, is_package: bool, known: set[str]) -> set[str]:
    """Absolute names of what a module imports; ``from X import y`` gives ``X.y`` when that is a module."""
    package = module if is_package else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join([*base_parts, node.module] if node.module else base_parts)
            else:
                base = node.module or ""
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                names.add(candidate if candidate in known else base)
        elif isinstance(node, ast.Call):  # importlib.import_module("x") / __import__("x")
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__") and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    names.add(arg.value)
    return names


def _import_graph() -> dict[str, set[str]]:
    """Project module -> the project modules it imports."""
    modules = _project_modules()
    known = set(modules)
    graph = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        imported = _imported_names(_parse(path), name, is_package, known)
        graph[name] = {dep for dep in imported if dep in known and dep != name}
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None when the graph is acyclic."""
    done: set[str] = set()
    stack: list[str] = []
    on_stack: set[str] = set()

    def visit(node: str) -> list[str] | None:
        stack.append(node)
        on_stack.add(node)
        for dep in sorted(graph.get(node, ())):
            if dep in on_stack:
                return [*stack[stack.index(dep) :], dep]
            if dep not in done:
                found = visit(dep)
                if found:
                    return found
        stack.pop()
        on_stack.discard(node)
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done:
            found = visit(start)
            if found:
                return found
    return None


# ----- the checker itself ---------------------------------------------------------------------


def test_cycle_finder() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"x": {"y"}, "y": {"y2"}, "y2": {"y"}}) == ["y", "y2", "y"]


def test_relative_and_submodule_imports_resolve() -> None:
    known = {"pkg", "pkg.sub", "pkg.sub.mod", "pkg.sub.other", "pkg.top"}
    tree = ast.parse(
        "from . import other\nfrom .. import top\nfrom ..sub.mod import thing\nfrom pkg.sub import CONST\n"
        "import pkg.top\nimport importlib\ndef f():\n    importlib.import_module('torch')\n"
    )
    assert _imported_names(tree, "pkg.sub.mod", False, known) == {
        "pkg.sub.other",
        "pkg.top",
        "pkg.sub.mod",
        "pkg.sub",
        "importlib",
        "torch",
    }


def test_graph_sees_the_real_imports() -> None:
    graph = _import_graph()
    assert {"clockworkd.cli.main", "slurm_hooks.runner", "linkpass", "torchpass"} <= set(graph)
    assert "clockworkd.cli.context" in graph["clockworkd.cli.main"]
    assert "clockworkd.sandbox.fabric" in graph["clockworkd.sandbox.cluster"]  # from clockworkd.sandbox import fabric
    assert "clockworkd.config" in graph["slurm_hooks.runner"]  # from clockworkd.config import load_config


# ----- the rules ------------------------------------------------------------------------------


def test_torch_only_in_torchpass_and_examples() -> None:
    offenders = []
    for path in _source_files():
        rel = path.relative_to(ROOT)
        if rel.parts[0] in TORCH_ALLOWED:
            continue
        for name in _imported_names(_parse(path), "", False, set()):
            if name == "torch" or name.startswith("torch."):
                offenders.append(f"{rel}: {name}")
    assert not offenders, "torch imported outside torchpass/: " + ", ".join(offenders)


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("linkpass", ("clockworkd", "slurm_hooks", "torchpass")),
        ("clockworkd", ("slurm_hooks", "torchpass")),
    ],
)
def test_dependency_direction(package: str, forbidden: tuple[str, ...]) -> None:
    offenders = []
    for path in _source_files(PACKAGES[package]):
        module, is_package = _module_name(path)
        for name in _imported_names(_parse(path), module, is_package, set()):
            if name.split(".")[0] in forbidden:
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not offenders, "\n".join(offenders)


# What TorchPass may use of clockworkd: its torch-free, client-side modules (the job key, the coordinator's wire
# protocol and its one client, option and hostlist parsing, the snapshot format and the messages to its writer
# process, the settings helper, the daemon's client for the event sink and borrowing, the command-line error
# handler, the one atomic file writer). Never the daemon itself (server, agent, Lens, LinkPass hosts): a rank
# must not load it, and the daemon may change without touching TorchPass.
TORCHPASS_MAY_IMPORT = {
    "clockworkd.atomic_file",
    "clockworkd.cli.invoke",
    "clockworkd.client",
    "clockworkd.config",  # the launcher reads the site's [snapshots] policy (torchpass.site_policy)
    "clockworkd.config_fields",
    "clockworkd.coordinator_client",
    "clockworkd.coordinator_replies",
    "clockworkd.coordinator_requests",
    "clockworkd.coordinator_wire",
    "clockworkd.errors",
    "clockworkd.hostlist",
    "clockworkd.job_options",
    "clockworkd.jobkey",
    "clockworkd.snapshots.messages",
    "clockworkd.snapshots.settings",
    "clockworkd.snapshots.store",
}


def test_torchpass_uses_only_clockworkds_client_side_modules() -> None:
    offenders = []
    for path in _source_files(PACKAGES["torchpass"]):
        module, is_package = _module_name(path)
        for name in _imported_names(_parse(path), module, is_package, set()):
            if name.split(".")[0] == "clockworkd" and not any(
                name == allowed or name.startswith(allowed + ".") for allowed in TORCHPASS_MAY_IMPORT
            ):
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not offenders, "\n".join(offenders)


def test_no_import_cycles() -> None:
    cycle = _find_cycle(_import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_utils_module() -> None:
    found = [str(p.relative_to(ROOT)) for p in _source_files() if p.name == "utils.py"]
    assert not found, f"name modules after what they do, not 'utils': {found}"


def test_every_module_has_a_docstring() -> None:
    missing = []
    for path in _source_files():
        text = path.read_text()
        if ast.get_docstring(ast.parse(text, filename=str(path))) is None:
            missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"modules without a docstring: {missing}"


TORCH_PRIVATE = re.compile(
    r"torch\._C\.|\._world\b|_abort_process_group\(|_get_default_group\(|_pg_registry|_init_backend=|"
    r"_get_fsdp_state\(|_fsdp_param_group|_unsharded_param\b"
)


def test_torch_private_api_only_in_torch_compat() -> None:
    """One place to check against a new torch release: every private use in torchpass is in torch_compat."""
    offenders = []
    for path in _source_files(PACKAGES["torchpass"]):
        if path.name == "torch_compat.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if TORCH_PRIVATE.search(code) and not code.strip().startswith(("``", '"', "'")):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "torch private API outside torchpass/torch_compat.py:\n" + "\n".join(offenders)


# Files that may unpickle: a snapshot read back from the job's own disk (its format is pickled state, like
# torch.load(weights_only=False)). Nothing that arrives over a socket is unpickled.
UNPICKLING_ALLOWED = {"torchpass/snapshot/restore.py"}


def test_nothing_is_unpickled_but_a_snapshot_from_disk() -> None:
    """pickle.loads / pickle.load / Unpickler anywhere else is a defect: bytes from a socket run what they name."""
    offenders = []
    for package in PACKAGES.values():
        for path in _source_files(package):
            if str(path.relative_to(ROOT)) in UNPICKLING_ALLOWED:
                continue
            for node in ast.walk(_parse(path)):
                if isinstance(node, ast.Attribute) and node.attr in {"loads", "load", "Unpickler"}:
                    if isinstance(node.value, ast.Name) and node.value.id in {"pickle", "cPickle", "dill"}:
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: pickle.{node.attr}")
    assert not offenders, "unpickling outside a snapshot read from disk:\n" + "\n".join(offenders)
