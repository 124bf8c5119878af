"""The package's import graph and sizes, read from the source (no process, no import).

* Every import of a dpserve module counts: at module level, inside functions and
  methods, under `if TYPE_CHECKING:` (see ARCHITECTURE.md, "Layers", for why).
* The graph has no cycle, and no edge goes up the layer order that ARCHITECTURE.md's
  "Layers" table gives: the test reads that table, so the map and the check are one.
* Files, classes and functions stay under the sizes of the style guide, and no
  package folder holds more than `MAX_FOLDER_MODULES` modules.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository (this file is tests/unit/...)
PACKAGE = ROOT / "dpserve"

MAX_FILE_LINES = 600
MAX_CLASS_LINES = 400
MAX_FUNCTION_LINES = 60
MAX_FOLDER_MODULES = 25  # .py files directly in one folder: more, and it wants subfolders
# Where the sizes hold so far (the rest of the package is being split now).


def module_files() -> dict[str, Path]:
    """dotted module name -> its file, for every module of the package."""
    mods = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def imported_names(module: str, path: Path) -> Iterator[tuple[str, int]]:
    """(dotted name, line) of everything `module` imports, wherever the import stands;
    `from X import y` yields X.y (a submodule, or a name that X defines)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            yield from ((f"{base}.{alias.name}", node.lineno) for alias in node.names)


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {dpserve module it imports: line of the first such import}."""
    mods = module_files()
    graph: dict[str, dict[str, int]] = {m: {} for m in mods}
    for module, path in mods.items():
        for name, line in imported_names(module, path):
            while name and name not in mods:  # X.y where y is not a module: X
                name = name.rpartition(".")[0]
            if name and name != module:
                graph[module].setdefault(name, line)
    return graph


def find_cycles(graph: dict[str, dict[str, int]]) -> list[tuple[list[str], set[str]]]:
    """One cycle [a, b, ..., a] through each tangle of modules that import each other
    (each strongly connected component of more than one module), with the tangle."""
    cycles = []
    for component in strongly_connected(graph):
        if len(component) > 1:
            inside = {a: {b for b in graph[a] if b in component} for a in component}
            cycles.append((cycle_from(min(component), inside), component))
    return cycles


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[set[str]]:
    """Tarjan's components, without recursion."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while (member := stack.pop()) != node:
                        component.add(member)
                    component.add(node)
                    on_stack.difference_update(component)
                    components.append(component)
            elif nxt not in index:
                index[nxt] = low[nxt] = len(index)
                stack.append(nxt)
                on_stack.add(nxt)
                work.append((nxt, iter(sorted(graph[nxt]))))
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
    return components


def cycle_from(start: str, inside: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through `start` in one component (breadth first)."""
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt_frontier = []
        for node in frontier:
            for nxt in sorted(inside[node]):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [start]
                if nxt not in parent:
                    parent[nxt] = node
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    raise AssertionError(f"no cycle through {start}")


def read_layers() -> dict[str, int]:
    """ARCHITECTURE.md's "Layers" table: module or folder (`engine`, `checkpoint/loader`,
    `__init__` for the package's face) -> its layer, 1 the lowest."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    layers = {}
    for row in re.finditer(r"^\|\s*(\d+)\s*\|([^|]*)\|", section, re.M):
        for name in re.findall(r"`([^`]+)`", row.group(2)):
            layers[name] = int(row.group(1))
    assert layers, "ARCHITECTURE.md has no Layers table"
    return layers


def layer_of(module: str, layers: dict[str, int]) -> int:
    """The layer of a module: its own row, else its folder's (the nearest one up)."""
    key = module.removeprefix("dpserve").removeprefix(".").replace(".", "/") or "__init__"
    while key:
        if key in layers:
            return layers[key]
        key = key.rpartition("/")[0]
    raise AssertionError(f"{module} is in no row of ARCHITECTURE.md's Layers table")


def show(module: str) -> str:
    return module.removeprefix("dpserve.").replace(".", "/")


def test_import_graph_has_no_cycle() -> None:
    graph = import_graph()
    cycles = [" -> ".join(f"{show(a)}:{graph[a][b]}" for a, b in zip(c, c[1:], strict=False))
              + f" -> {show(c[-1])}  (tangle: {', '.join(sorted(map(show, tangle)))})"
              for c, tangle in find_cycles(graph)]
    assert not cycles, "import cycles (module:line of the import):\n" + "\n".join(cycles)


def test_imports_follow_the_layer_order() -> None:
    layers = read_layers()
    graph = import_graph()
    upward = [f"{show(a)}:{line} imports {show(b)} (layer {layer_of(a, layers)} -> "
              f"{layer_of(b, layers)})"
              for a, edges in sorted(graph.items()) for b, line in sorted(edges.items())
              if layer_of(b, layers) > layer_of(a, layers)]
    assert not upward, "imports against ARCHITECTURE.md's layer order:\n" + "\n".join(upward)


def test_the_layer_table_names_real_modules() -> None:
    known = {show(m) if m != "dpserve" else "__init__" for m in module_files()}
    unknown = [name for name in read_layers() if name not in known]
    assert not unknown, f"Layers rows name no module of the package: {unknown}"


def oversized(path: Path) -> Iterator[str]:
    """What in one file passes the size limits: the file, a class, a function."""
    source = path.read_text()
    rel = path.relative_to(PACKAGE)
    lines = source.count("\n")
    if lines > MAX_FILE_LINES:
        yield f"{rel}: {lines} lines (file limit {MAX_FILE_LINES})"
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.ClassDef):
            limit, kind = MAX_CLASS_LINES, "class"
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            limit, kind = MAX_FUNCTION_LINES, "function"
        else:
            continue
        size = node.end_lineno - node.lineno + 1
        if size > limit:
            yield f"{rel}:{node.lineno} {kind} {node.name}: {size} lines (limit {limit})"


def sized_files() -> list[Path]:
    """Every module of the package."""
    return sorted(PACKAGE.rglob("*.py"))


def test_files_classes_and_functions_stay_small() -> None:
    files = sized_files()
    assert len(files) > 40, "the size check reads too few files"
    found = [line for path in files for line in oversized(path)]
    assert not found, "over the size limits:\n" + "\n".join(found)


def crowded_folders() -> list[str]:
    """Each package folder with more than MAX_FOLDER_MODULES modules directly in it."""
    folders = [PACKAGE, *(p for p in sorted(PACKAGE.rglob("*")) if p.is_dir()
                          and (p / "__init__.py").exists())]
    counts = {folder: len(list(folder.glob("*.py"))) for folder in folders}
    return [f"{folder.relative_to(ROOT)}/: {n} modules (limit {MAX_FOLDER_MODULES})"
            for folder, n in counts.items() if n > MAX_FOLDER_MODULES]


def test_no_folder_holds_too_many_modules() -> None:
    assert len(list(PACKAGE.glob("*.py"))) > 5, "the folder check reads too few modules"
    found = crowded_folders()
    assert not found, "package folders over the module limit:\n" + "\n".join(found)


MAX_TESTS_FOLDER_FILES = 40


def test_no_tests_folder_holds_more_than_40_files() -> None:
    """tests/ and each folder under it hold at most 40 files (caches aside), and no two
    test modules share a name: pytest imports each by its name alone."""
    tests = ROOT / "tests"
    folders = [tests, *sorted(p for p in tests.rglob("*") if p.is_dir()
                              and "__pycache__" not in p.parts)]
    assert len(folders) > 5, "the layout check reads too few folders"
    crowded = [f"{folder.relative_to(ROOT)}: {count} files"
               for folder in folders
               if (count := sum(p.is_file() for p in folder.iterdir())) > MAX_TESTS_FOLDER_FILES]
    assert not crowded, f"over {MAX_TESTS_FOLDER_FILES} files:\n" + "\n".join(crowded)
    names = [p.name for p in tests.rglob("test_*.py")]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
