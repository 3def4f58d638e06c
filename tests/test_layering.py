"""The import layering of the installed package, read from the source with `ast`.

Data flows one way: the CLI (every `pagedctl.*` module outside `pagedctl.engine` and
`pagedctl.kernels`) -> `pagedctl.engine` -> `pagedctl.kernels`. Checked over every module of the
package, imports inside functions included (a lazy import that hides a circle is what this
forbids); imports under `if TYPE_CHECKING:` are left out (they never run):

- no import cycle between modules (strongly connected components of more than one module);
- no arrow back up: the kernels import neither the engine nor the CLI, the engine does not import
  the CLI (`pagedctl` itself, for `__version__`, is the CLI too);
- the CLI uses no private name (`_x`) of the engine or the kernels;
- the CLI imports the engine's public surface only (`pagedctl.engine`, its `__init__`), never a
  module behind it, and no kernel: a module moved inside the engine changes its export table only;
- inside the engine, the wings import down only: core <- models <- runner <- sizing <- the
  front (`llm`, `requests`, ... at the top of engine/) <- scale_out; the core imports no torch.

`from pkg import name` is an import of `pkg.name` when that is a module, else of `pkg`; importing
a package means its `__init__`, i.e. the package module. `check_layering` takes any tree, so the
last test shows it failing on a small broken one.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Import name -> folder, as [tool.setuptools] package-dir in pyproject.toml maps them.
PACKAGE_DIRS = {
    "pagedctl": "pagedctl",
    "pagedctl.engine": "engine",
    "pagedctl.kernels": "kernels",
    "pagedctl.recipes": "recipes",
}
KERNELS, ENGINE, CLI = "kernels", "engine", "CLI"
RANK = {CLI: 2, ENGINE: 1, KERNELS: 0}
# The engine's wings, lowest first; a module at the top of engine/ is the front. The facade
# (engine/__init__.py) loads names from every wing on demand and is no wing.
WINGS = ("core", "models", "runner", "sizing", "front", "scale_out")


@dataclass(frozen=True)
class Import:
    """One import statement's edge: `importer` (a module) reads `target` (a module)."""

    importer: str
    target: str
    path: Path
    line: int
    text: str  # the statement as written, for the report
    names: tuple[str, ...] = ()  # for `from target import names`: the names taken from it


@dataclass
class Report:
    cycles: list[list[Import]] = field(default_factory=list)  # the edges inside each cycle
    upward: list[Import] = field(default_factory=list)
    private: list[Import] = field(default_factory=list)
    behind: list[Import] = field(default_factory=list)  # the CLI past the engine's surface

    def ok(self) -> bool:
        return not (self.cycles or self.upward or self.private or self.behind)


@dataclass(frozen=True)
class Layers:
    """The package's import name and its two lower layers' packages; the rest is the CLI."""

    top: str = "pagedctl"
    engine: str = "pagedctl.engine"
    kernels: str = "pagedctl.kernels"

    def of(self, module: str) -> str:
        for name, kind in ((self.kernels, KERNELS), (self.engine, ENGINE)):
            if module == name or module.startswith(name + "."):
                return kind
        return CLI

    def below_root(self, module: str) -> list[str]:
        """The parts of an engine/kernels module's name under its layer's package."""
        root = self.kernels if self.of(module) == KERNELS else self.engine
        return module[len(root) :].split(".")[1:]


def collect_modules(root: Path, package_dirs: dict[str, str]) -> dict[str, Path]:
    """Module name -> file for every `.py` file under the mapped folders."""
    modules: dict[str, Path] = {}
    for package, folder in package_dirs.items():
        base = root / folder
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("").parts
            if "__pycache__" in rel:
                continue
            if rel[-1] == "__init__":
                rel = rel[:-1]
            modules[".".join((package, *rel))] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST):
    """Every node of the tree except those only under `if TYPE_CHECKING:` (its else runs)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _dotted(node: ast.expr) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _nearest_module(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(
    module: str, path: Path, modules: dict[str, Path], prefix: str
) -> tuple[list[Import], dict[str, str]]:
    """The module's imports of the package's own modules, and the names it binds to modules."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    lines = path.read_text(encoding="utf-8").splitlines()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    edges: list[Import] = []
    aliases: dict[str, str] = {}  # local name -> module it is bound to

    def own(name: str) -> bool:
        return name == prefix or name.startswith(prefix + ".")

    def add(target: str, node: ast.stmt, names: tuple[str, ...] = ()) -> None:
        resolved = _nearest_module(target, modules)
        if resolved is None:
            return
        text = lines[node.lineno - 1].strip()
        edges.append(Import(module, resolved, path, node.lineno, text, names))

    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not own(alias.name):
                    continue
                add(alias.name, node)
                if alias.asname:
                    aliases[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    aliases[top] = top
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - (node.level - 1)])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            if not own(base):
                continue
            plain = []
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in modules:
                    add(sub, node)
                    aliases[alias.asname or alias.name] = sub
                else:
                    plain.append(alias.name)
            if plain or not node.names:
                add(base, node, tuple(plain))
    return edges, aliases


def _private_uses(
    module: str, path: Path, aliases: dict[str, str], modules: dict[str, Path], layers: Layers
) -> list[Import]:
    """`mod._name` attribute reads of an engine/kernels module bound by an import."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    lines = path.read_text(encoding="utf-8").splitlines()
    found = []
    for node in _runtime_nodes(tree):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        dotted = _dotted(node.value)
        if dotted is None:
            continue
        head, _, rest = dotted.partition(".")
        if head not in aliases:
            continue
        target = f"{aliases[head]}.{rest}" if rest else aliases[head]
        if target in modules and layers.of(target) != CLI:
            text = lines[node.lineno - 1].strip()
            found.append(Import(module, target, path, node.lineno, text, (node.attr,)))
    return found


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components (iterative), each sorted; only those of more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def wing_of(module: str, engine: str = "pagedctl.engine") -> str | None:
    """The wing of an engine module (None: the facade, or not the engine)."""
    if module == engine or not module.startswith(engine + "."):
        return None
    head = module[len(engine) + 1 :].split(".")[0]
    return head if head in WINGS else "front"


def wing_violations(root: Path, package_dirs: dict[str, str] = PACKAGE_DIRS) -> list[Import]:
    """Imports from one engine wing up to a higher one (see WINGS)."""
    modules = collect_modules(root, package_dirs)
    found = []
    for module, path in modules.items():
        src = wing_of(module)
        if src is None:
            continue
        for edge in imports_of(module, path, modules, "pagedctl")[0]:
            dst = wing_of(edge.target)
            if dst is not None and WINGS.index(dst) > WINGS.index(src):
                found.append(edge)
    return found


def check_layering(
    root: Path, package_dirs: dict[str, str] = PACKAGE_DIRS, layers: Layers = Layers()
) -> Report:
    """Cycles, upward arrows and the CLI's private-name imports of the tree at `root`."""
    modules = collect_modules(root, package_dirs)
    edges: list[Import] = []
    report = Report()
    for module, path in modules.items():
        found, aliases = imports_of(module, path, modules, layers.top)
        edges += found
        if layers.of(module) == CLI:
            report.private += _private_uses(module, path, aliases, modules, layers)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for edge in edges:
        if edge.target != edge.importer:
            graph[edge.importer].add(edge.target)
        src, dst = layers.of(edge.importer), layers.of(edge.target)
        if RANK[dst] > RANK[src]:
            report.upward.append(edge)
        taken = (*layers.below_root(edge.target), *edge.names) if dst != CLI else ()
        if src == CLI and any(_private(n) for n in taken):
            report.private.append(edge)
        if src == CLI and dst != CLI and edge.target != layers.engine:
            report.behind.append(edge)
    for component in strongly_connected(graph):
        members = set(component)
        report.cycles.append([e for e in edges if e.importer in members and e.target in members])
    return report


def _where(edge: Import, root: Path) -> str:
    try:
        shown = edge.path.relative_to(root)
    except ValueError:
        shown = edge.path
    return f"{shown}:{edge.line}: {edge.importer} -> {edge.target}: {edge.text}"


def describe(edges: list[Import], root: Path) -> str:
    return "\n".join(_where(e, root) for e in sorted(edges, key=lambda e: (str(e.path), e.line)))


@pytest.fixture(scope="module")
def report() -> Report:
    return check_layering(ROOT)


def test_the_module_map_is_the_installed_one() -> None:
    """The folders read here are the ones pyproject.toml installs, each package declared."""
    tomllib = pytest.importorskip("tomllib") if sys.version_info >= (3, 11) else None
    if tomllib is None:
        pytest.skip("tomllib needs Python 3.11")
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"] == PACKAGE_DIRS
    modules = collect_modules(ROOT, PACKAGE_DIRS)
    packages = sorted(m for m, p in modules.items() if p.name == "__init__.py")
    assert packages == sorted(setuptools["packages"]), "a package folder the wheel would leave out"
    folders = {p.parent for p in modules.values()}
    loose = sorted(str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").is_file())
    assert not loose, f"modules outside any package (not installed): {loose}"
    assert len(modules) > 80


def test_no_import_cycles(report: Report) -> None:
    text = "\n\n".join(describe(edges, ROOT) for edges in report.cycles)
    assert not report.cycles, f"{len(report.cycles)} import cycle(s):\n{text}"


def test_no_upward_imports(report: Report) -> None:
    assert not report.upward, (
        "imports against the CLI -> engine -> kernels direction:\n" + describe(report.upward, ROOT)
    )


def test_the_cli_uses_no_private_names_of_the_engine_or_kernels(report: Report) -> None:
    assert not report.private, "private names of the engine/kernels used by the CLI:\n" + describe(
        report.private, ROOT
    )


def test_the_cli_imports_the_engines_surface_only(report: Report) -> None:
    assert not report.behind, (
        "the CLI imports past `pagedctl.engine` (export the name from engine/__init__.py):\n"
        + describe(report.behind, ROOT)
    )


def test_the_engines_wings_import_down_only() -> None:
    up = wing_violations(ROOT)
    assert not up, f"imports up the wings ({' <- '.join(WINGS)}):\n" + describe(up, ROOT)


def test_the_core_is_torch_free() -> None:
    """Every core module imports with torch made unimportable, and none of them loads it."""
    core = sorted(m for m in collect_modules(ROOT, PACKAGE_DIRS) if wing_of(m) == "core")
    assert len(core) >= 10, core
    code = (
        "import sys\n"
        "class NoTorch:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'torch':\n"
        "            raise ImportError('the core imported torch: ' + name)\n"
        "sys.meta_path.insert(0, NoTorch())\n"
        f"for m in {core!r}:\n"
        "    __import__(m)\n"
        "assert 'torch' not in sys.modules\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr


def test_the_wing_checker_catches_an_arrow_up(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "cli/__init__.py": "",
            "eng/__init__.py": "from .runner import step\n",  # the facade: no wing
            "eng/core/__init__.py": "",
            "eng/core/sched.py": "def f():\n    from ..runner.step import run\n",
            "eng/runner/__init__.py": "",
            "eng/runner/step.py": "from ..core.sched import f\n",
            "eng/llm.py": "from .scale_out import pool\n",
            "eng/scale_out/__init__.py": "",
            "eng/scale_out/pool.py": "from ..llm import x\n",
        },
    )
    dirs = {"pagedctl": "cli", "pagedctl.engine": "eng"}
    up = {(e.importer, e.target) for e in wing_violations(tmp_path, dirs)}
    assert up == {
        ("pagedctl.engine.core.sched", "pagedctl.engine.runner.step"),
        ("pagedctl.engine.llm", "pagedctl.engine.scale_out.pool"),
    }


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checker_catches_a_broken_tree(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "cli/__init__.py": "__version__ = '1'\n",
            "cli/main.py": "from pkg.eng.core import run\nfrom pkg.eng import core as c\n"
            "x = c._hidden\n",
            "cli/opts.py": "from pkg.kern.ops import _fast\n",
            "eng/__init__.py": "",
            # a cycle a lazy (function-level) import hides, and an arrow up to the CLI's package
            "eng/core.py": "from pkg.eng import util\nfrom pkg.kern import ops\n\n"
            "def run():\n    from pkg import __version__\n",
            "eng/util.py": "def f():\n    from . import core\n",
            "eng/typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from pkg.cli_only import x\nelse:\n    from pkg.kern import ops\n",
            "kern/__init__.py": "",
            "kern/ops.py": "import pkg.eng.core\n",  # up from the kernels, closing a second circle
            "kern/clean.py": "import os\nfrom pkg.kern import ops\n",
        },
    )
    dirs = {"pkg": "cli", "pkg.eng": "eng", "pkg.kern": "kern"}
    report = check_layering(tmp_path, dirs, Layers("pkg", "pkg.eng", "pkg.kern"))
    assert not report.ok()
    (cycle,) = report.cycles
    assert sorted({e.importer for e in cycle}) == ["pkg.eng.core", "pkg.eng.util", "pkg.kern.ops"]
    assert "eng/util.py:2: pkg.eng.util -> pkg.eng.core" in describe(cycle, tmp_path)
    up = {(e.path.relative_to(tmp_path).as_posix(), e.line, e.target) for e in report.upward}
    assert up == {("eng/core.py", 5, "pkg"), ("kern/ops.py", 1, "pkg.eng.core")}
    private = {(e.path.name, e.line, e.names) for e in report.private}
    assert private == {("main.py", 3, ("_hidden",)), ("opts.py", 1, ("_fast",))}
    behind = {(e.path.name, e.line, e.target) for e in report.behind}
    assert behind == {
        ("main.py", 1, "pkg.eng.core"),
        ("main.py", 2, "pkg.eng.core"),
        ("opts.py", 1, "pkg.kern.ops"),
    }
    message = describe(report.upward, tmp_path)
    assert "eng/core.py:5: pkg.eng.core -> pkg: from pkg import __version__" in message
    # the TYPE_CHECKING-only import counts for nothing; its else branch does
    typed = [e for e in report.upward + report.private if e.path.name == "typed.py"]
    assert typed == []
