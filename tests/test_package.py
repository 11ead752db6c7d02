"""The shape of the package a learner opens: its folders are its layers (but the lessons: the
top-level modules and collectives/), and imports go one way.

Layers, and what each may import (each folder's __init__ says the same):

    runtime    torch-version shims, backend and device, topology, sockets, links, groups    nothing of zeronb
    pool       the rank processes a notebook drives (zeronb.start / run / %%ranks)           runtime
    lessons    the top-level modules: shards, collectives, ledger, cost, precision,          runtime
               memory, models, checkpoint
    minimal    each algorithm in its shortest form, for reading first (zeronb.minimal)        runtime
    zero       the stages (zeronb's and PyTorch's) and what watches them                     lessons, runtime
    train      RunConfig -> a run on a pool or under torchrun, and its report                zero, lessons, pool, runtime
    book       the chapters' helpers and exercises                                           all but bench
    bench      the benchmarks                                                                all but book

The package's root (__init__, __main__) stands outside the layers: it may import any of them.

The import graph is read from the source with `ast`: every import, inside functions too, and
`from .pkg import name` counts as an import of the submodule of pkg that defines `name`.
"""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "zeronb"
BELOW = {"runtime": set(), "pool": {"runtime"}, "lessons": {"runtime"}, "minimal": {"runtime"}, "zero": {"lessons", "runtime"},
         "train": {"zero", "lessons", "pool", "runtime"}}
BELOW["book"] = BELOW["bench"] = set(BELOW) | BELOW["train"]
LAYERS = tuple(BELOW)


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _parse(package: pathlib.Path) -> dict:
    """{module name: (path, ast)} for every .py file under `package`."""
    root = package.parent
    return {_module_name(p, root): (p, ast.parse(p.read_text())) for p in package.rglob("*.py")}


def _absolute(node: ast.ImportFrom, module: str, path: pathlib.Path) -> str:
    if not node.level:
        return node.module or ""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
    return ".".join(anchor + ([node.module] if node.module else []))


def _defining(modules: dict, module: str, name: str, seen=()) -> str:
    """The module that defines `name` as `module` exposes it: a package's re-export is followed to
    the submodule it comes from."""
    if f"{module}.{name}" in modules:  # a submodule
        return f"{module}.{name}"
    path, tree = modules[module]
    for node in tree.body:  # module level: where the name is bound
        if isinstance(node, ast.ImportFrom) and module not in seen:
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    source = _absolute(node, module, path)
                    if source in modules:
                        return _defining(modules, source, alias.name, seen + (module,))
    return module


def imports(package: pathlib.Path = PACKAGE) -> dict:
    """{module: set of the package's modules it imports, anywhere in the file}."""
    modules = _parse(package)
    top = package.name
    graph = {}
    for name, (path, tree) in modules.items():
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = _absolute(node, name, path)
                if base == top or base.startswith(top + "."):
                    for alias in node.names:
                        found.add(_defining(modules, base, alias.name) if base in modules else base)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value and node.value in modules:
                found.add(node.value)  # a module named to be imported later (importlib, a preload list)
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


def layer(module: str):
    """The layer of a zeronb module; None for the package's root (__init__, __main__: commands)."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return None
    return parts[1] if parts[1] in LAYERS else "lessons"


def upward_imports(graph) -> list:
    """(module, imported module) pairs where a layer imports one it may not (BELOW)."""
    out = []
    for m, deps in graph.items():
        for d in deps:
            if layer(m) is not None and layer(d) is not None and layer(d) != layer(m) and layer(d) not in BELOW[layer(m)]:
                out.append((m, d))
    return sorted(out)


def test_no_import_cycle_between_zeronbs_modules():
    graph = imports()
    assert "zeronb.runtime.groups" in graph["zeronb.collectives.hierarchical"] | graph["zeronb.zero.zeropp"], graph
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_no_layer_imports_a_higher_one():
    assert upward_imports(imports()) == []


def _plant(tmp_path, files: dict) -> pathlib.Path:
    package = tmp_path / "pkg"
    for name, text in files.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    return package


def test_the_graph_sees_a_cycle_made_by_a_function_local_import(tmp_path):
    package = _plant(tmp_path, {"__init__.py": "", "low.py": "def f():\n    from .high import g\n    return g()\n",
                                "high.py": "from .low import f\n\ndef g():\n    return 1\n"})
    assert _cycle(imports(package)) in (["pkg.high", "pkg.low", "pkg.high"], ["pkg.low", "pkg.high", "pkg.low"])


def test_the_graph_follows_a_packages_reexport_to_the_submodule(tmp_path):
    # the shape of the circle issue 25 found: low -> (pkg.zero re-exports) zero.stages -> low
    package = _plant(tmp_path, {"__init__.py": "", "low.py": "def f():\n    from .zero import groups\n",
                                "zero/__init__.py": "from .config import groups\n",
                                "zero/config.py": "from ..low import f\n\ndef groups():\n    pass\n"})
    graph = imports(package)
    assert "pkg.zero.config" in graph["pkg.low"]
    assert _cycle(graph) is not None


def test_the_graph_sees_a_module_named_in_a_string(tmp_path):
    package = _plant(tmp_path, {"__init__.py": "", "runtime/__init__.py": "", "zero/__init__.py": "",
                                "runtime/warm.py": 'import importlib\nNAMES = ["pkg.zero.stage"]\n',
                                "zero/stage.py": ""})
    assert upward_imports(imports(package)) == [("pkg.runtime.warm", "pkg.zero.stage")]


def test_the_direction_test_fails_on_a_lower_layer_importing_a_higher_one(tmp_path):
    package = _plant(tmp_path, {"__init__.py": "", "runtime/__init__.py": "",
                                "runtime/groups.py": "def f():\n    from ..zero import stage\n",
                                "zero/__init__.py": "", "zero/stage.py": "from ..runtime import groups\n"})
    assert upward_imports(imports(package)) == [("pkg.runtime.groups", "pkg.zero.stage")]


def test_the_stages_may_not_reach_into_the_pool(tmp_path):
    # the pool is a branch beside the lessons, not a rung below the stages: only training drives it
    package = _plant(tmp_path, {"__init__.py": "", "pool/__init__.py": "", "pool/cluster.py": "",
                                "zero/__init__.py": "", "zero/stage.py": "from ..pool import cluster\n",
                                "train/__init__.py": "", "train/runner.py": "from ..pool import cluster\n"})
    assert upward_imports(imports(package)) == [("pkg.zero.stage", "pkg.pool.cluster")]


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_every_layer_says_what_it_is_and_what_it_may_import():
    for folder in [p for p in PACKAGE.iterdir() if (p / "__init__.py").exists()]:
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
        assert doc and "import" in doc, f"{folder.name}/__init__.py: say what the layer is and what it may import"


def test_the_version_shims_import_nothing_from_zeronb():
    assert imports()["zeronb.runtime.compat"] == set()


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_is_longer_than_420_lines(path):
    assert len(path.read_text().splitlines()) <= 420


def test_the_pool_class_reads_in_one_sitting():
    tree = ast.parse((PACKAGE / "pool" / "cluster.py").read_text())
    cluster = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Cluster")
    assert cluster.end_lineno - cluster.lineno + 1 <= 250


def chapter_functions(notebooks=ROOT / "notebooks") -> dict:
    """{function name: chapters that define it at the top level of a code cell}."""
    import json

    from IPython.core.inputtransformer2 import TransformerManager

    python = TransformerManager().transform_cell  # line magics (%pip, !ls) become Python
    found = {}
    for path in sorted(notebooks.glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] != "code":
                continue
            source = "".join(cell["source"])
            if source.lstrip().startswith("%%"):  # a cell magic (%%ranks): its body is rank code
                source = source.split("\n", 1)[1] if "\n" in source else ""
            for node in ast.parse(python(source)).body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    found.setdefault(node.name, set()).add(path.stem)
    return found


def test_no_helper_is_defined_in_two_chapters():
    """Plumbing two chapters need is the package's (a function, a RankReport property); a name a
    chapter defines is its own lesson."""
    shared = {name: sorted(chapters) for name, chapters in chapter_functions().items() if len(chapters) > 1}
    assert shared == {}


def test_the_duplicate_finder_sees_a_helper_in_two_chapters(tmp_path):
    import json

    for name in ("01_a", "02_b"):
        cell = {"cell_type": "code", "source": ["def sent(r):\n", "    return sum(r.values())\n"], "metadata": {}}
        (tmp_path / f"{name}.ipynb").write_text(json.dumps({"cells": [cell]}))
    assert chapter_functions(tmp_path) == {"sent": {"01_a", "02_b"}}


def local_imports_without_a_reason(package: pathlib.Path = PACKAGE) -> list:
    """Imports of zeronb's own modules inside functions whose line does not say why: a function-local
    import may defer a heavy import (and says so), never dodge a cycle."""
    out = []
    for name, (path, tree) in _parse(package).items():
        lines = path.read_text().splitlines()
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(package.name)):
                        if "(deferred" not in lines[node.lineno - 1] and "(inside" not in lines[node.lineno - 1]:
                            out.append(f"{name}:{node.lineno}")
    return sorted(set(out))


def test_every_function_local_import_says_why():
    assert local_imports_without_a_reason() == []


def test_the_local_import_check_sees_an_unexplained_one(tmp_path):
    package = _plant(tmp_path, {"__init__.py": "", "a.py": "def f():\n    from .b import g\n    return g\n",
                                "b.py": "def g():\n    from .a import f  # (deferred: heavy)\n"})
    assert local_imports_without_a_reason(package) == ["pkg.a:2"]
