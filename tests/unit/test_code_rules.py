"""Static rules over the source tree, checked with ``ast`` (nothing is imported or executed).

The packages (docs/architecture.md, "Packages"): ``clockwork.contracts`` (torch-free code that ranks, hooks, daemon and
CLI share), ``clockwork.cli``, ``clockwork.sandbox``, ``clockwork.audit``, ``clockworkd`` (the node daemon alone),
``slurm_hooks``, ``linkpass`` and ``torchpass``. Every import counts, including ones inside functions.

- torch is imported only by torchpass/ (and examples/, an ordinary user script; bench/, whose scripts run real
  training; tests/ may test either), and inside torchpass only by its torch subpackages (rank/, sharded/,
  transparent/, frameworks/, snapshot/, rollout/): coordinator/, launch/ and the shared top-level modules import
  none, and load none that does (followed through every import, package markers included);
- dependency direction:
  - a rank's code (torchpass) imports of Clockwork only ``clockwork.contracts``: never the daemon, the CLI, the
    sandbox, the audit, the hooks or linkpass;
  - ``clockwork.contracts`` imports no other Clockwork package (of linkpass only its settings dataclass);
  - ``clockworkd`` imports no CLI, sandbox, audit, hooks or torchpass; the CLI, the sandbox, the audit and the hooks
    import no ``clockworkd`` (they reach a daemon through the contracts' client and start it as a program);
  - nothing imports ``clockwork.sandbox`` but ``clockwork.cli``; linkpass imports no other Clockwork package;
  - the ``clockwork`` marker imports nothing;
- no import cycles among all of them;
- no module named utils.py;
- torch's private API (``torch._C``, c10d's ``_world``, ``_abort_process_group``, ``_get_default_group``, a mesh's
  ``_pg_registry``, ``DeviceMesh(_init_backend=...)``, FSDP2's parameter groups) is used only in
  torchpass/rank/torch_compat.py, which checks the torch release it was tested with;
- nothing is unpickled but a snapshot read back from disk;
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
    "clockwork": ROOT / "clockwork",
    "clockworkd": ROOT / "daemon" / "clockworkd",
    "slurm_hooks": ROOT / "slurm_hooks",
    "linkpass": ROOT / "linkpass",
    "torchpass": ROOT / "torchpass",
}
SKIP_DIRS = {"build", "dist", "__pycache__", "node_modules"}
TORCH_ALLOWED = {"torchpass", "examples", "bench", "tests"}
#: The subpackages of torchpass that may import torch; everything else in torchpass imports none and loads none.
TORCH_SUBPACKAGES = ("rank", "sharded", "transparent", "frameworks", "snapshot", "rollout")


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


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:`` (never run)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING":
            skipped.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    return skipped


def _imported_names(
    tree: ast.Module, module: str, is_package: bool, known: set[str], *, run_only: bool = False
) -> set[str]:
    """Absolute names of what a module imports; ``from X import y`` gives ``X.y`` when that is a module.
    ``run_only``: leave out what is imported under ``if TYPE_CHECKING:``."""
    package = module if is_package else module.rpartition(".")[0]
    skipped = _type_checking_only(tree) if run_only else set()
    names = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
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


def _import_graph(*, run_only: bool = False) -> dict[str, set[str]]:
    """Project module -> the project modules it imports (``run_only``: what running it loads, so also the package
    markers above each of those, and not what it imports for type checking only)."""
    modules = _project_modules()
    known = set(modules)
    graph = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        imported = _imported_names(_parse(path), name, is_package, known, run_only=run_only)
        if run_only:
            imported |= {parent for dep in imported for parent in _parents(dep)} | set(_parents(name))
        graph[name] = {dep for dep in imported if dep in known and dep != name}
    return graph


def _parents(module: str) -> list[str]:
    """``a.b.c`` -> [``a``, ``a.b``]: the package markers importing it runs first."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _in(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _imports_of(package: str) -> Iterator[tuple[Path, str]]:
    """(file, imported name) for every import in ``package`` (a dotted name: its modules and subpackages)."""
    top = package.split(".")[0]
    base = PACKAGES[top].joinpath(*package.split(".")[1:])
    for path in _source_files(base) if base.is_dir() else [base.with_suffix(".py")]:
        module, is_package = _module_name(path)
        for name in _imported_names(_parse(path), module, is_package, set()):
            yield path, name


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
    assert {"clockwork.cli.main", "slurm_hooks.runner", "linkpass", "torchpass"} <= set(graph)
    assert "clockwork.cli.context" in graph["clockwork.cli.main"]
    assert "clockwork.sandbox.fabric" in graph["clockwork.sandbox.cluster"]  # from clockwork.sandbox import fabric
    assert "clockwork.contracts.config" in graph["slurm_hooks.runner"]  # from ...contracts.config import load_config
    assert "clockworkd.lens.host" in graph["clockworkd.agent"]
    assert "torchpass.rank.step" in graph["torchpass.rank.context"]


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


def test_torch_only_in_torchpass_torch_subpackages() -> None:
    """Inside torchpass, torch is imported only by rank/, sharded/, transparent/, frameworks/, snapshot/, rollout/."""
    offenders = []
    for path in _source_files(PACKAGES["torchpass"]):
        module, is_package = _module_name(path)
        if _in(module, *(f"torchpass.{sub}" for sub in TORCH_SUBPACKAGES)):
            continue
        for name in _imported_names(_parse(path), module, is_package, set()):
            if name == "torch" or name.startswith("torch."):
                offenders.append(f"{path.relative_to(ROOT)}: {name}")
    assert not offenders, "torch imported outside torchpass's torch subpackages: " + ", ".join(offenders)


def test_coordinator_launch_and_shared_modules_load_no_torch() -> None:
    """What the coordinator, the launchers and the node agents run never loads a module that imports torch, through
    any chain of imports (a package marker that re-exports one included)."""
    graph = _import_graph(run_only=True)
    modules = _project_modules()
    torch_modules = {
        name
        for name, path in modules.items()
        if any(
            _in(imported, "torch")
            for imported in _imported_names(_parse(path), name, path.name == "__init__.py", set(), run_only=True)
        )
    }
    starts = [m for m in graph if _in(m, "torchpass.coordinator", "torchpass.launch")]
    starts += [
        m
        for m in graph
        if m.count(".") == 1 and m.startswith("torchpass.") and m.split(".")[1] not in TORCH_SUBPACKAGES
    ]
    assert {"torchpass.coordinator.service", "torchpass.launch.agent", "torchpass.cli"} <= set(starts)
    offenders = []
    for start in sorted(starts):
        seen, todo, via = {start}, [start], {start: start}
        while todo:
            module = todo.pop()
            for dep in sorted(graph.get(module, ())):
                if dep not in seen:
                    seen.add(dep)
                    via[dep] = module
                    todo.append(dep)
        for hit in sorted(seen & torch_modules)[:1]:
            chain = [hit]
            while chain[-1] != start:
                chain.append(via[chain[-1]])
            offenders.append(" <- ".join(chain))
    assert not offenders, "torch-free modules that load torchpass's torch modules:\n" + "\n".join(offenders)


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("linkpass", ("clockwork", "clockworkd", "slurm_hooks", "torchpass")),
        (
            "clockwork.contracts",
            ("clockworkd", "clockwork.cli", "clockwork.sandbox", "clockwork.audit", "slurm_hooks", "torchpass"),
        ),
        ("clockworkd", ("clockwork.cli", "clockwork.sandbox", "clockwork.audit", "slurm_hooks", "torchpass")),
        ("clockwork.cli", ("clockworkd", "slurm_hooks", "torchpass")),
        ("clockwork.sandbox", ("clockworkd", "clockwork.cli", "clockwork.audit", "slurm_hooks", "torchpass")),
        ("clockwork.audit", ("clockworkd", "clockwork.cli", "clockwork.sandbox", "slurm_hooks", "torchpass")),
        ("slurm_hooks", ("clockworkd", "clockwork.cli", "clockwork.sandbox", "clockwork.audit", "torchpass")),
        ("torchpass", ("clockworkd", "clockwork.cli", "clockwork.sandbox", "clockwork.audit", "slurm_hooks")),
    ],
)
def test_dependency_direction(package: str, forbidden: tuple[str, ...]) -> None:
    offenders = [
        f"{path.relative_to(ROOT)} imports {name}" for path, name in _imports_of(package) if _in(name, *forbidden)
    ]
    assert not offenders, "\n".join(offenders)


def test_a_rank_imports_only_the_contracts_of_clockwork() -> None:
    """torchpass (what every training rank runs) imports of Clockwork only ``clockwork.contracts``, and no linkpass:
    a rank must not load the daemon, and the daemon may change without touching TorchPass."""
    offenders = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path, name in _imports_of("torchpass")
        if name.split(".")[0] in ("clockwork", "clockworkd", "linkpass", "slurm_hooks")
        and not _in(name, "clockwork.contracts")
    ]
    assert not offenders, "\n".join(offenders)


def test_contracts_take_only_linkpass_settings() -> None:
    """The contracts' configuration schema includes LinkPass's section, defined in linkpass (which must not import
    Clockwork); nothing else of linkpass."""
    offenders = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path, name in _imports_of("clockwork.contracts")
        if _in(name, "linkpass") and name != "linkpass.settings"
    ]
    assert not offenders, "\n".join(offenders)


def test_only_the_cli_imports_the_sandbox() -> None:
    offenders = []
    for top in PACKAGES:
        for path, name in _imports_of(top):
            module = _module_name(path)[0]
            if _in(name, "clockwork.sandbox") and not _in(module, "clockwork.sandbox", "clockwork.cli"):
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not offenders, "\n".join(offenders)


def test_the_clockwork_marker_imports_nothing() -> None:
    """``import clockwork.contracts`` in a rank must not load the CLI, the sandbox or the audit."""
    tree = _parse(PACKAGES["clockwork"] / "__init__.py")
    assert not any(isinstance(node, ast.Import | ast.ImportFrom) for node in ast.walk(tree))


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
    assert not offenders, "torch private API outside torchpass/rank/torch_compat.py:\n" + "\n".join(offenders)


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
