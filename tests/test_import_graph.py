"""The shipped tree's import graph, read from the source: no module imports, even lazily inside a function, a module
that imports it back, and the remote-code files import nothing of the installed package but the optional kernels
(docs/design.md, Layout and import names)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _package_dirs() -> dict[str, str]:
    """setup.py's PACKAGE_DIRS: the installed import name of each design-card folder."""
    tree = ast.parse((ROOT / "setup.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "PACKAGE_DIRS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py defines no PACKAGE_DIRS")


PACKAGES = _package_dirs()
REMOTE_CODE = ROOT / "modeling_kimik3"
# the one door from the remote code into the package: the optional fast twins, found by name at run time
REMOTE_CODE_MAY_IMPORT = ("kimik3.kernels",)


def _modules() -> dict[str, Path]:
    modules = {}
    for package, folder in PACKAGES.items():
        for path in sorted((ROOT / folder).glob("*.py")):
            name = package if path.name == "__init__.py" else f"{package}.{path.stem}"
            modules[name] = path
    return modules


def _imported(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Every module named by an import statement anywhere in the file (functions included), absolute or relative,
    plus `importlib.import_module("...")` with a literal name, except the remote code's door to the optional kernels
    (`REMOTE_CODE_MAY_IMPORT`): the kernels package stands above the remote code (it implements the references'
    contracts and reads their interface version) and is found by name at run time, never imported by a statement."""
    base = module if is_package else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base.split(".")
                anchor = ".".join(parts[: len(parts) - node.level + 1])
                target = f"{anchor}.{node.module}" if node.module else anchor
            else:
                target = node.module
            if node.module:
                names.add(target)
            # `from . import x` names module x (or a name of the package, which resolves to the package)
            names.update(f"{target}.{alias.name}" for alias in node.names)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and not (module.startswith("kimik3.modeling.") and node.args[0].value in REMOTE_CODE_MAY_IMPORT)):
            names.add(node.args[0].value)
    return names


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        targets = _imported(tree, name, path.name == "__init__.py")
        # a name resolves to the longest module of ours it names (`kimik3.modeling.ops_kimi_k3.situ_glu` -> ops)
        edges = set()
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.add(target)
        graph[name] = edges
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of the graph, or None (a package importing its own submodules through `__init__` is an
    edge like any other)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_module_of_the_tree_imports_one_that_imports_it_back():
    graph = _graph()
    assert len(graph) > 40, sorted(graph)  # every shipped module was read
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_lazy_and_relative_cycles():
    """The reader sees an import inside a function and a relative `from . import x`; the finder reports the loop."""
    tree = ast.parse("def f():\n    from . import b\n")
    assert "kimik3.kernels.b" in _imported(tree, "kimik3.kernels.a", False)
    tree = ast.parse("from .c import x\n")
    assert "kimik3.modeling.c" in _imported(tree, "kimik3.modeling.a", False)
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


@pytest.mark.parametrize("path", sorted(REMOTE_CODE.glob("*_kimi_k3.py")), ids=lambda p: p.name)
def test_remote_code_imports_nothing_of_the_package_but_the_kernels(path):
    """A model folder's copy of these files runs without the package, and never against a package of another version
    (the kernels' door checks an interface version)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    reached = sorted(name for name in _imported(tree, "kimik3.modeling." + path.stem, False)
                     if (name == "kimik3" or name.startswith("kimik3.")) and not name.startswith("kimik3.modeling.")
                     and not name.startswith(REMOTE_CODE_MAY_IMPORT))
    assert reached == [], f"{path.name} imports {reached} from the installed package"


def _design_table_order() -> list[str]:
    """The remote-code files in the order docs/design.md's ground-floor-up table lists them."""
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    table = text.split("The remote code, from the ground floor up", 1)[1].split("\n\n", 2)[1]
    order = []
    for row in table.splitlines()[2:]:
        first_cell = row.split("|")[1]
        order += [name.strip("` ") for name in first_cell.split(",")]
    return order


def test_the_design_docs_floors_are_the_codes():
    """docs/design.md lists every remote-code file once, from the ground floor up: each imports only files listed
    before it."""
    order = _design_table_order()
    assert sorted(order) == sorted(p.name for p in REMOTE_CODE.glob("*_kimi_k3.py"))
    graph = _graph()
    position = {f"kimik3.modeling.{name[:-3]}": index for index, name in enumerate(order)}
    upward = [(module, imported) for module, index in position.items() for imported in graph[module]
              if position.get(imported, -1) >= index]
    assert upward == [], f"files importing one listed after them in docs/design.md: {upward}"
