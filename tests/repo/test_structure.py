"""The packages import in one direction: no import cycle inside ``twinkle_kernels``,
``twinkle_megatron`` or ``patches`` (imported as ``twinkle_patches``), and inside the first two
each layer imports only the layers below it (the tables below).

The imports are read from the source with ``ast``, nothing is executed: module-level and
function-level ``import`` / ``from ... import`` statements (relative ones resolved, ``from . import x``
counted as an import of the submodule ``x`` when there is one) and ``importlib.import_module`` /
``__import__`` calls with a literal name. Imports under ``if TYPE_CHECKING:`` are not counted (they
never run). A function-level import is still an import: moving one into a function does not break
a cycle, it only hides it. Importing ``a.b.c`` also runs ``a/b/__init__.py`` (Python initialises
every package on the way), so it counts as an import of the package ``a.b`` too, unless the
importer is inside ``a.b`` (whose initialisation has then already begun): a module that imports
back into a package that imports it is a cycle.

Private names stay in their module. Within one top-level package no module imports a private name
(one leading underscore, not a dunder) that another module defines: not ``from .x import _y``, not
``from pkg.x import _y``, not ``x._y`` on an imported module ``x``; what two modules share has a
public name. A package-private *module* of the same top-level package (``twinkle_kernels._dispatch``,
``twinkle_kernels.linear_ce._chunked``) may be imported: those modules are the package's internal
core. Across the top-level packages (:data:`TOP_LEVEL`: ``twinkle_kernels``, ``twinkle_megatron``,
``twinkle_patches``, ``benchmarks`` and the ``examples`` scripts) nothing private is reached at all:
no component of an imported module path and no imported name may be private, so ``twinkle_patches``
uses what ``twinkle_kernels`` makes public. This scan counts the imports under ``if TYPE_CHECKING:``
too (naming a private type is reaching in all the same). ``tests/`` is exempt.

The facade's objects keep their private attributes to themselves: outside ``model.py`` no module of
``twinkle_megatron`` reads or writes ``<x>._name`` where ``<x>`` is the facade (any name ending in
``model``: ``model``, ``self.model``, ``teacher_model``), and outside ``training/engine.py`` none
does so on the engine or a train state (``engine``, ``state``). What the training functions need is
passed to them, or is a public attribute (:data:`OWN_PRIVATES`).
"""
import ast
import os

import pytest

from conftest import ROOT

# (directory in the repository, import name)
PACKAGES = [
    pytest.param("twinkle_kernels", "twinkle_kernels", id="twinkle_kernels"),
    pytest.param("twinkle_megatron", "twinkle_megatron", id="twinkle_megatron"),
    pytest.param("patches", "twinkle_patches", id="patches"),
]
# The layers of twinkle_megatron, lowest first: layer -> (its modules: a module or a package,
# named relative to twinkle_megatron, "" for the package itself; the layers it may import). A
# module may import the modules of its own layer and of the layers listed, nothing else of the
# package: so nothing imports the job, the layer modules import neither the spec nor the facade,
# and the spec builder knows no family (model.py -> config.py / convert.py / lora/ -> models/ ->
# spec.py -> layers/ -> packing.py).
_BELOW_FACADE = ("checkpoint", "weight_sync", "training", "bridge", "models", "spec", "parallel", "layers", "packing",
                 "options", "validate", "versions")
MEGATRON_LAYERS = {
    # the megatron-core releases and their API differences: the bottom, anything may ask it
    "versions": (("versions",), ()),
    "packing": (("packing",), ()),
    "validate": (("validate",), ()),
    # MegatronModel's settings objects (precision, recompute, DDP overlap), checked when made
    "options": (("options",), ()),
    "layers": (("layers",), ("packing", "versions")),
    "parallel": (("parallel",), ("options", "versions")),
    "spec": (("spec",), ("layers", "packing", "versions")),
    "models": (("models",), ("spec", "layers", "packing", "versions")),
    # the HF <-> megatron pieces over the family registry: config translation, the weight
    # converter, LoRA
    "bridge": (("config", "convert", "lora"), ("models", "spec", "layers", "options", "packing", "validate",
                                               "versions")),
    # (validate: the call's input checks, before any collective)
    "training": (("training",), ("parallel", "layers", "packing", "validate", "versions")),
    "checkpoint": (("checkpoint",), ("bridge", "parallel", "validate", "versions")),
    # the live weights streamed in HF names (on the converter's export) and loaded into HF models
    "weight_sync": (("weight_sync",), ("bridge", "versions")),
    "facade": (("", "model", "hub", "template", "upstream", "sampling"), _BELOW_FACADE),
    "job": (("job",), ("facade",) + _BELOW_FACADE),
    # the memory plan: the facade's name tables and sharding rules, no megatron process
    "plan": (("plan",), ("bridge", "models", "spec", "layers", "packing", "validate", "versions")),
}
# twinkle_kernels: the shared core (dispatch, backends, checks, custom-op helpers) imports no op
# package; an op package imports only itself, the core and the NPU helpers; the package itself,
# ``python -m twinkle_kernels``, its self-check and the Triton compile lane (which drive the
# public ops) sit on top.
_KERNEL_CORE = ("_activations", "_alloc", "_backends", "_checks", "_cpu_ext", "_custom_ops", "_dispatch", "_dtypes",
                "_triton_utils", "_verifiers", "patching", "registry", "testing", "npu")
_KERNEL_OPS = ("norm", "rope", "swiglu", "gdn", "moe", "linear_ce", "packed_attention", "sum_squares", "adamw", "wgrad")
KERNEL_LAYERS = {
    "core": (_KERNEL_CORE, ()),
    **{op: ((op,), ("core",)) for op in _KERNEL_OPS},
    "top": (("", "__main__", "_selfcheck", "_triton_aot"), ("core",) + _KERNEL_OPS),
}
# The top-level packages of the private-name rule: (directory in the repository, import name).
# examples/ holds scripts, not a package: its files are scanned under the name "examples".
TOP_LEVEL = (("twinkle_kernels", "twinkle_kernels"), ("twinkle_megatron", "twinkle_megatron"),
             ("patches", "twinkle_patches"), ("benchmarks", "benchmarks"), ("examples", "examples"))
# Where a model type may be named: the family folders, and the job's embedded tiny configs (data)
MODEL_TYPE_HOMES = ("twinkle_megatron/models/", "twinkle_megatron/job/")


def package_modules(directory: str, name: str) -> dict:
    """``{module name: (path, is_package)}`` for every ``.py`` file under ``directory``."""
    modules = {}
    base = os.path.join(ROOT, directory)
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        rel = os.path.relpath(dirpath, base)
        parts = [name] + ([] if rel == "." else rel.split(os.sep))
        if "__init__.py" not in filenames:
            continue  # not a package: python cannot import its files as modules of this one
        for f in sorted(filenames):
            if not f.endswith(".py"):
                continue
            if f == "__init__.py":
                modules[".".join(parts)] = (os.path.join(dirpath, f), True)
            else:
                modules[".".join(parts + [f[:-3]])] = (os.path.join(dirpath, f), False)
    return modules


def _type_checking_block(node) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _walk(tree):
    """ast.walk without the bodies of ``if TYPE_CHECKING:`` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if _type_checking_block(node):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _literal_name(node, module: str):
    """The module name of ``importlib.import_module("x")`` / ``__import__("x")`` calls (also
    ``f"{__name__}.x"``), else None."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    f = node.func
    if not ((isinstance(f, ast.Attribute) and f.attr == "import_module")
            or (isinstance(f, ast.Name) and f.id in ("import_module", "__import__"))):
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr):
        out = []
        for v in arg.values:
            if isinstance(v, ast.Constant):
                out.append(v.value)
            elif isinstance(v, ast.FormattedValue) and isinstance(v.value, ast.Name) and v.value.id == "__name__":
                out.append(module)
            else:
                return None
        return "".join(out)
    return None


def from_base(node: ast.ImportFrom, package: str):
    """The module a ``from ... import`` statement imports from, relative levels resolved against
    ``package`` (the importer's package); None when the level climbs above the top package."""
    if not node.level:
        return node.module
    parts = package.split(".")
    if node.level - 1 >= len(parts):
        return None
    base = ".".join(parts[:len(parts) - (node.level - 1)])
    return f"{base}.{node.module}" if node.module else base


def imports_of(module: str, path: str, is_package: bool, modules: dict) -> set:
    """The modules of ``modules`` that ``module`` (source at ``path``) imports."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    package = module if is_package else module.rpartition(".")[0]
    found = set()

    def add(name):
        # "a.b.c" names module a.b.c if it exists, else the closest enclosing module of ours
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if not name or name == module:
            return
        found.add(name)
        # and the packages on the way, which Python initialises first, unless this module is in
        # them (then their initialisation has already begun)
        parent = name.rpartition(".")[0]
        while parent in modules and parent != package and not package.startswith(parent + "."):
            found.add(parent)
            parent = parent.rpartition(".")[0]

    for node in _walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = from_base(node, package)
            if base is None:
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                # `from pkg import sub` imports the submodule; `from pkg import name` runs pkg
                add(sub if sub in modules else base)
        else:
            name = _literal_name(node, module)
            if name:
                add(name)
    return found


def import_graph(directory: str, name: str) -> dict:
    modules = package_modules(directory, name)
    return {m: imports_of(m, path, is_pkg, modules) for m, (path, is_pkg) in modules.items()}


def find_cycles(graph: dict) -> list:
    """The strongly connected components of ``graph`` with more than one module (or a module that
    imports itself), each as a sorted list (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1 or node in graph.get(node, ()):
                    out.append(sorted(comp))
    return out


def layer_violations(graph: dict, package: str, layers: dict) -> list:
    """``"module imports [...]"`` for every import of ``graph`` (one package's import graph) that
    ``layers`` (a table like :data:`MEGATRON_LAYERS`) does not allow; also every module that no
    layer holds and every layer entry that holds no module (so the table cannot go stale)."""
    def full(rel):
        return f"{package}.{rel}" if rel else package

    def in_entry(module, rel):
        name = full(rel)
        return module == name or (rel != "" and module.startswith(name + "."))

    def layer_of(module):
        hits = [name for name, (entries, _) in layers.items() if any(in_entry(module, e) for e in entries)]
        return hits[0] if len(hits) == 1 else None

    out = []
    for name, (entries, _) in layers.items():
        for rel in entries:
            if not any(in_entry(m, rel) for m in graph):
                out.append(f"layer {name!r}: {full(rel)} is not a module of {package}")
    for module in sorted(graph):
        own = layer_of(module)
        if own is None:
            out.append(f"{module} is in no layer (or in several): place it in the table")
            continue
        allowed = {own, *layers[own][1]}
        up = sorted(m for m in graph[module] if layer_of(m) not in allowed)
        if up:
            out.append(f"{module} ({own}) imports {up}: only {sorted(allowed)} are allowed")
    return out


def test_find_cycles_finds_a_cycle_and_only_cycles():
    graph = {"p": {"p.a"}, "p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}}
    assert find_cycles(graph) == [["p.a", "p.b", "p.c"]]
    assert find_cycles({"p": {"p.a"}, "p.a": set()}) == []


def _graph(tmp_path, files: dict) -> dict:
    for rel, text in files.items():
        path = tmp_path / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    modules = package_modules(str(tmp_path / "pkg"), "pkg")
    return {m: imports_of(m, p, is_pkg, modules) for m, (p, is_pkg) in modules.items()}


def test_imports_are_resolved(tmp_path):
    """Relative, function-level, ``from . import x`` and literal ``import_module`` imports count;
    ``TYPE_CHECKING`` ones do not; importing a submodule counts its package (``pkg.sub``) too."""
    graph = _graph(tmp_path, {
        "__init__.py": "from .a import f\n",
        "a.py": "def f():\n    from . import b\n",
        "b.py": "import importlib\nimportlib.import_module('pkg.sub.c')\n",
        "sub/__init__.py": "",
        "sub/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .. import a\nfrom .. import f\n"})
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.sub.c", "pkg.sub"},
                     "pkg.sub": set(), "pkg.sub.c": {"pkg"}}
    assert find_cycles(graph) == [["pkg", "pkg.a", "pkg.b", "pkg.sub.c"]]


def test_a_module_importing_back_into_the_package_that_imports_it_is_a_cycle(tmp_path):
    """``pkg/op/__init__.py`` imports ``pkg._lib``, which imports ``pkg.op._args`` (in a function):
    running that import initialises ``pkg.op`` first, so the two import each other. A module inside
    ``pkg.op`` importing its sibling is no such cycle."""
    graph = _graph(tmp_path, {
        "__init__.py": "",
        "_lib.py": "def check():\n    from .op import _args\n",
        "op/__init__.py": "from .. import _lib\nfrom . import _args\n",
        "op/_args.py": "",
        "op/_library.py": "from . import _args\n"})
    assert graph["pkg._lib"] == {"pkg.op._args", "pkg.op"}
    assert graph["pkg.op._library"] == {"pkg.op._args"}
    assert find_cycles(graph) == [["pkg._lib", "pkg.op"]]


def test_layer_violations_are_found():
    layers = {"low": (("low",), ()), "high": (("", "high"), ("low",))}
    graph = {"p": {"p.high"}, "p.high": {"p.low"}, "p.low": {"p.low.x"}, "p.low.x": set()}
    assert layer_violations(graph, "p", layers) == []
    graph["p.low.x"] = {"p.high"}
    assert layer_violations(graph, "p", layers) == [
        "p.low.x (low) imports ['p.high']: only ['low'] are allowed"]
    graph["p.stray"] = set()
    assert "p.stray is in no layer (or in several): place it in the table" in layer_violations(graph, "p", layers)
    assert "layer 'low': p.gone is not a module of p" in layer_violations(
        graph, "p", {**layers, "low": (("low", "gone"), ())})


@pytest.mark.parametrize("directory,name", PACKAGES)
def test_no_import_cycle(directory, name):
    graph = import_graph(directory, name)
    assert len(graph) > 3, f"{directory}: found only {sorted(graph)}"
    cycles = find_cycles(graph)
    assert not cycles, "import cycles (each a set of modules that import each other):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


@pytest.mark.parametrize("name,layers", [("twinkle_megatron", MEGATRON_LAYERS), ("twinkle_kernels", KERNEL_LAYERS)])
def test_each_layer_imports_only_the_layers_below(name, layers):
    graph = import_graph(name, name)
    assert "twinkle_megatron.layers.norm" in graph or "twinkle_kernels.norm._library" in graph
    bad = layer_violations(graph, name, layers)
    assert not bad, "\n".join(bad)


def is_private(name: str) -> bool:
    """One leading underscore, or two without the trailing two of a dunder (``__version__`` is public)."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def source_files(directory: str, name: str) -> dict:
    """``{module name: (path, is_package)}`` for every ``.py`` file under ``directory``, packages or
    not (the ``examples`` scripts are named as if their folder were the package ``name``)."""
    files = {}
    base = os.path.join(ROOT, directory)
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        rel = os.path.relpath(dirpath, base)
        parts = [name] + ([] if rel == "." else rel.split(os.sep))
        for f in sorted(filenames):
            if f.endswith(".py"):
                module = ".".join(parts if f == "__init__.py" else parts + [f[:-3]])
                files[module] = (os.path.join(dirpath, f), f == "__init__.py")
    return files


def private_imports(module: str, path: str, is_package: bool, modules: dict, tops) -> list:
    """``(line, dotted name, why)`` for every private name ``module`` (source at ``path``) reaches in
    another module of ``tops`` (the top-level package names); ``modules``: every module of those
    packages, to tell a submodule (``from . import _dispatch``) from a name defined in a module."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    own = module.split(".")[0]
    package = module if is_package else module.rpartition(".")[0]
    across, inside = f"private, reached from {own}", "a private name of another module"
    found = set()

    def check_names(line, dotted, names):
        """``names`` taken from the module ``dotted``."""
        for n in names:
            if not is_private(n) or f"{dotted}.{n}" == module:
                continue
            if dotted.split(".")[0] != own:
                found.add((line, f"{dotted}.{n}", across))
            elif f"{dotted}.{n}" not in modules:
                found.add((line, f"{dotted}.{n}", inside))

    def check(line, dotted, names=()):
        """``dotted``: an imported module; ``names``: what is imported from it."""
        if dotted.split(".")[0] not in tops:
            return
        if dotted.split(".")[0] != own and any(is_private(p) for p in dotted.split(".")[1:]):
            found.add((line, dotted, across))
        check_names(line, dotted, names)

    bound = {}  # local name -> the module of ours it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                check(node.lineno, alias.name)
                top = alias.name.split(".")[0]
                if top in tops:
                    bound[alias.asname or top] = alias.name if alias.asname else top
        elif isinstance(node, ast.ImportFrom):
            base = from_base(node, package)
            if base is None:
                continue
            names = [a.name for a in node.names if a.name != "*"]
            check(node.lineno, base, names)
            bound.update((a.asname or a.name, f"{base}.{a.name}") for a in node.names if f"{base}.{a.name}" in modules)
        else:
            name = _literal_name(node, module)
            if name:
                check(node.lineno, name)
    # x._y / pkg.sub._y on a bound module: follow the submodules, check the first name that is not one
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain, value = [], node
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if not isinstance(value, ast.Name) or value.id not in bound:
            continue
        dotted = bound[value.id]
        for attr in reversed(chain):
            if f"{dotted}.{attr}" not in modules:
                check_names(node.lineno, dotted, (attr,))
                break
            dotted = f"{dotted}.{attr}"
            if is_private(attr) and dotted.split(".")[0] != own:
                found.add((node.lineno, dotted, across))
    return sorted(found)


def private_import_violations(packages=TOP_LEVEL, root: str = ROOT) -> list:
    """``"file:line: dotted name (why)"`` (files relative to ``root``) for every private name that
    a module of ``packages`` reaches in another module."""
    files, modules = {}, {}
    for directory, name in packages:
        files.update(source_files(directory, name))
        modules.update(package_modules(directory, name))
    modules.update(files)
    tops = {name for _, name in packages}
    out = []
    for module, (path, is_pkg) in sorted(files.items()):
        rel = os.path.relpath(path, root).replace(os.sep, "/")
        found = private_imports(module, path, is_pkg, modules, tops)
        out += [f"{rel}:{line}: {dotted} ({why})" for line, dotted, why in found]
    return out


def test_private_names_are_found_in_every_form(tmp_path):
    """Inside a package: private names of another module, imported or read off a module, are
    found; its private modules are not. Across packages: private modules and names both, also
    through ``importlib`` and under ``TYPE_CHECKING``; dunders and one's own names are public."""
    files = {
        "pkg/__init__.py": "__version__ = '1'\n_flag = 1\n",
        "pkg/_core.py": "_y = 1\nz = 2\n",
        "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ._core import _y\n"
                    "def f():\n    return _g()\ndef _g():\n    pass\n",
        "pkg/b.py": "import pkg.a\nfrom . import _core, a\nfrom .a import f, _g\nfrom . import _flag, __version__\n"
                    "a._g(); a.f(); _core.z; pkg.a._g()\nfrom pkg.a import _g as g\n",
        "app/__init__.py": "",
        "app/c.py": "import importlib\nimport pkg\nimport pkg._core\nfrom pkg import __version__, a\n"
                    "from pkg._core import z\nfrom pkg.a import f, _g\nimportlib.import_module('pkg._core')\n"
                    "a._g(); pkg._core.z; a.f()\n",
        "scripts/run.py": "from app import c\nfrom pkg import _flag\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    packages = [(str(tmp_path / d), d) for d in ("pkg", "app", "scripts")]
    inside, across = "a private name of another module", "private, reached from"
    assert private_import_violations(packages, root=str(tmp_path)) == [
        f"app/c.py:3: pkg._core ({across} app)",
        f"app/c.py:5: pkg._core ({across} app)",
        f"app/c.py:6: pkg.a._g ({across} app)",
        f"app/c.py:7: pkg._core ({across} app)",
        f"app/c.py:8: pkg._core ({across} app)",
        f"app/c.py:8: pkg.a._g ({across} app)",
        f"pkg/a.py:3: pkg._core._y ({inside})",
        f"pkg/b.py:3: pkg.a._g ({inside})",
        f"pkg/b.py:4: pkg._flag ({inside})",
        f"pkg/b.py:5: pkg.a._g ({inside})",
        f"pkg/b.py:6: pkg.a._g ({inside})",
        f"scripts/run.py:2: pkg._flag ({across} scripts)",
    ]


def test_no_private_name_is_imported_across_modules():
    bad = private_import_violations()
    assert not bad, ("private names reached in another module (give what is shared a public name, or "
                     "move it; see the module docstring):\n" + "\n".join(bad))


# object name (the last identifier of the expression, matched at its end) -> the one module that
# may use its private attributes
OWN_PRIVATES = {"model": "twinkle_megatron/model.py", "engine": "twinkle_megatron/training/engine.py",
                "state": "twinkle_megatron/training/engine.py"}


def private_attribute_uses(path: str, rel: str) -> list:
    """``rel:line: expr._name`` for each private attribute of a facade object (:data:`OWN_PRIVATES`)
    used in the file at ``path`` (``rel``: its path from the repository root) outside its module."""
    out = []
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if not (isinstance(node, ast.Attribute) and is_private(node.attr)):
            continue
        base = node.value
        last = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
        if last is None:
            continue
        for suffix, home in OWN_PRIVATES.items():
            if last.endswith(suffix) and rel != home:
                out.append((node.lineno, node.col_offset, f"{rel}:{node.lineno}: {ast.unparse(node)}"))
                break
    return [text for _, _, text in sorted(out)]


def test_private_attribute_scan_sees_each_form(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f(model, engine, x):\n"
                   "    model._states['a']\n"            # read
                   "    self.model._bind()\n"            # through an attribute
                   "    engine._finalize = None\n"       # write
                   "    teacher_model._chunks\n"
                   "    x._private, model.public, model.__class__\n")
    assert private_attribute_uses(str(src), "twinkle_megatron/x.py") == [
        "twinkle_megatron/x.py:2: model._states", "twinkle_megatron/x.py:3: self.model._bind",
        "twinkle_megatron/x.py:4: engine._finalize", "twinkle_megatron/x.py:5: teacher_model._chunks"]
    assert private_attribute_uses(str(src), "twinkle_megatron/model.py") == ["twinkle_megatron/model.py:4: engine._finalize"]


def test_no_private_attribute_of_the_facade_is_used_outside_it():
    bad = []
    for dirpath, dirnames, files in os.walk(os.path.join(ROOT, "twinkle_megatron")):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                bad += private_attribute_uses(path, os.path.relpath(path, ROOT).replace(os.sep, "/"))
    assert not bad, ("private attributes of the facade, the engine or a train state used outside their "
                     "module (pass what is needed, or make it public):\n" + "\n".join(bad))


def _registered_model_types() -> set:
    """The ``MODEL_TYPES`` tuples of every family folder's ``config.py``, read with ``ast``."""
    types = set()
    base = os.path.join(ROOT, "twinkle_megatron", "models")
    for family in sorted(os.listdir(base)):
        path = os.path.join(base, family, "config.py")
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "MODEL_TYPES" for t in node.targets):
                types |= set(ast.literal_eval(node.value))
    return types


def _model_type_literals(tree, types) -> list:
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in types]


def test_only_the_families_name_model_types():
    """Nothing above the model families branches on a family: outside ``twinkle_megatron/models/``
    (and the job's embedded configs) no string literal is a registered ``model_type``."""
    types = _registered_model_types()
    assert {"llama", "qwen3", "qwen3_moe", "qwen3_5"} <= types, sorted(types)
    found = []
    for module, (path, _) in sorted(package_modules("twinkle_megatron", "twinkle_megatron").items()):
        rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
        if rel.startswith(MODEL_TYPE_HOMES):
            continue
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        found += [f"{rel}:{line}: {value!r}" for line, value in _model_type_literals(tree, types)]
    assert not found, "model types named outside the family folders:\n" + "\n".join(found)


def test_the_model_type_scan_sees_a_branch():
    tree = ast.parse("if shape.model_type in ('qwen3_moe', 'other'):\n    moe = 'qwen3_moe_x'\n")
    assert _model_type_literals(tree, _registered_model_types()) == [(1, "qwen3_moe")]
