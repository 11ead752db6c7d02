"""The shape of the package a learner opens: no import cycle between zeronb's modules (counting
imports inside functions too), the version shims in a module that imports nothing from zeronb, and
the pool's class short enough to read in one sitting."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "zeronb"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict:
    """{module: set of zeronb modules it imports, anywhere in the file}."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:  # `from . import x` may import a submodule x
                    found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def _cycle(graph):
    """A cycle of imports, as a list of modules, or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        state[m] = "done"
        stack.pop()
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def _packages_of(graph):
    """Imports of a package's own submodules by its __init__ (re-exports) are not cycles of concepts:
    leave out the edges from a package to its children."""
    return {m: {n for n in deps if not n.startswith(m + ".")} for m, deps in graph.items()}


def test_no_import_cycle_between_zeronbs_modules():
    graph = _packages_of(_imports())
    assert graph["zeronb.backend"] and graph["zeronb.collectives"], graph  # (the graph is not empty)
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_version_shims_import_nothing_from_zeronb():
    assert _imports()["zeronb.compat"] == set()


def test_the_pool_class_reads_in_one_sitting():
    tree = ast.parse((PACKAGE / "cluster.py").read_text())
    cluster = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Cluster")
    assert cluster.end_lineno - cluster.lineno + 1 <= 250
