"""The package's import structure, read from the source with ``ast`` (nothing is imported).

* No import cycle among p2prl modules, whether only the imports that run when a module is
  imported count (those at module level and in class bodies, including under module-level
  ``if`` / ``try``) or those inside functions too (lazy imports, which keep torch and hivemind
  out of ``p2prl --help``): a lazy import defers a dependency, it does not remove it, and a
  cycle through one still ties a low-level module to everything above it (one that lazily
  imports the CLI depends on all that the CLI imports). ``import_module("p2prl.x")``, with the
  module's name written out or in a module-level constant, counts as a lazy import of it.
  Imports under ``if TYPE_CHECKING:``, which never run, never count.
* A module imports (lazily too) only from its own floor of the package and those below
  (``FLOORS``; ``UPWARD`` names the known exceptions, and must shrink to empty).
* Every module logs by its own name, ``logging.getLogger(__name__)``.
* No class is over 300 lines, no function or method over 60.
* No module uses another module's private (underscore-prefixed) name, whether imported
  (``from p2prl.x import _name``, lazy imports included) or reached through a module
  (``import p2prl.x as m; m._name``). Dunder names (``__version__``) are public.
* Nothing reaches past the transport seam: outside ``p2prl/net/transport.py`` (and ``dht.py``,
  which starts hivemind), no module touches a transport's hivemind objects (``transport.dht``,
  ``node.transport.p2p``) or looks them up by name (``getattr(x, "dht")``); the roles use the
  transport's capabilities instead.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "p2prl"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, tuple[Path, ast.Module]]:
    return {_module_name(p): (p, ast.parse(p.read_text(), filename=str(p))) for p in sorted(PACKAGE.rglob("*.py"))}


MODULES = _modules()


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _absolute(module: str, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` reads from (relative imports resolved against ``module``)."""
    if not node.level:
        return node.module or ""
    is_package = MODULES[module][0].name == "__init__.py"
    base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _import_time_nodes(tree: ast.AST, lazy: bool = False):
    """The nodes that run when the module is imported: not function bodies (``lazy``: those too), not
    ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(tree):
        if not lazy and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            yield from (n for stmt in child.orelse for n in [stmt, *_import_time_nodes(stmt, lazy)])
            continue
        yield child
        yield from _import_time_nodes(child, lazy)


def _targets(module: str, node: ast.Import | ast.ImportFrom | ast.Call) -> list[str]:
    """The p2prl modules an import statement (or an ``import_module`` call) loads explicitly."""
    if isinstance(node, ast.Call):
        name = _string(node.args[0], MODULES[module][1]) if node.args else None
        return [name] if name in MODULES else []
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in MODULES]
    source = _absolute(module, node)
    if source not in MODULES:
        return []
    subs = [f"{source}.{a.name}" for a in node.names if f"{source}.{a.name}" in MODULES]
    plain = [a for a in node.names if f"{source}.{a.name}" not in MODULES]
    return subs + ([source] if plain else [])


def _string(node: ast.AST, tree: ast.Module) -> object:
    """The value of ``node`` when it is a constant, or the name of one that ``tree`` assigns at module level."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        constants = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                     and isinstance(n.value, ast.Constant) for t in n.targets if isinstance(t, ast.Name)}
        return constants.get(node.id)
    return None


def _is_import(node: ast.AST) -> bool:
    """An import statement, or a call of ``import_module`` / ``importlib.import_module``."""
    if isinstance(node, ast.Call):
        func = node.func
        return (func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute)
                else None) == "import_module"
    return isinstance(node, (ast.Import, ast.ImportFrom))


def import_graph(lazy: bool = False) -> dict[str, set[str]]:
    """module -> the p2prl modules it imports when imported (``lazy``: or in any of its functions)."""
    graph = {}
    for name, (_, tree) in MODULES.items():
        graph[name] = {t for n in _import_time_nodes(tree, lazy) if _is_import(n)
                       for t in _targets(name, n) if t != name}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan), as a path."""
    index, low, stack, on_stack, sccs = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                sccs.append(set(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for scc in sccs:  # a shortest path from the component's first module back to itself
        start = min(scc)
        paths, seen = [[start]], {start}
        while paths:
            path = paths.pop(0)
            nxt = sorted(w for w in graph[path[-1]] if w in scc)
            if start in nxt:
                cycles.append([*path, start])
                break
            for w in nxt:
                if w not in seen:
                    seen.add(w)
                    paths.append([*path, w])
    return cycles


def private_uses() -> list[str]:
    """``module:line: what`` for every use of another p2prl module's private name."""
    found = []
    for name, (path, tree) in MODULES.items():
        aliases = {}  # local name -> the p2prl module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in MODULES:
                        aliases[a.asname or a.name] = a.name
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(name, node)
                if source not in MODULES:
                    continue
                for a in node.names:
                    if f"{source}.{a.name}" in MODULES:
                        aliases[a.asname or a.name] = f"{source}.{a.name}"
                    if _private(a.name) and source != name:
                        found.append(f"{name}:{node.lineno}: imports {a.name} from {source}")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                    and aliases.get(node.value.id, name) != name):
                found.append(f"{name}:{node.lineno}: uses {aliases[node.value.id]}.{node.attr}")
    return found


HIVEMIND_OBJECTS = {"dht", "p2p"}  # a HivemindTransport's own
NETWORK_MODULES = {"p2prl.net.transport", "p2prl.net.dht"}


def transport_internals() -> list[str]:
    """``module:line: what`` for every use of a transport's hivemind objects outside ``NETWORK_MODULES``."""
    found = []
    for name, (_, tree) in MODULES.items():
        if name in NETWORK_MODULES:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in HIVEMIND_OBJECTS:
                owner = node.value
                if (isinstance(owner, ast.Name) and owner.id == "transport"
                        or isinstance(owner, ast.Attribute) and owner.attr == "transport"):
                    found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                  and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                  and node.args[1].value in HIVEMIND_OBJECTS):
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_checks_see_the_package():
    assert {"p2prl.cli", "p2prl.experiments.grid", "p2prl.procs", "p2prl.launch.fork", "p2prl.algo"} <= set(MODULES)
    graph, lazy = import_graph(), import_graph(lazy=True)
    assert "p2prl.experiments.grid" in graph["p2prl.experiments.latency"]
    assert "p2prl.launch.fork" in graph["p2prl.launch.local"]
    assert "p2prl.launch.local" not in graph["p2prl.cli"]  # imported inside _cmd_swarm
    assert "p2prl.launch.local" in lazy["p2prl.cli"]
    assert "p2prl.learner.loop" in lazy["p2prl.launch.local"]  # import_module("p2prl.learner.loop"), to preload it


def test_the_checks_can_fail():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []
    assert every_cycle({"a": {"b"}, "b": {"a", "c"}, "c": {"b"}}) == [["a", "b", "a"], ["b", "c", "b"]]
    probe = ast.parse("import typing\nif typing.TYPE_CHECKING:\n    import p2prl.cli\nALGO = 'p2prl.algo'\n"
                      "def f():\n    from p2prl import procs\n    importlib.import_module('p2prl.cli')\n"
                      "    import_module(ALGO)\n    import_module(name)\n")
    MODULES["p2prl._layout_probe"] = (PACKAGE / "_layout_probe.py", probe)
    try:
        assert import_graph()["p2prl._layout_probe"] == set()
        assert import_graph(lazy=True)["p2prl._layout_probe"] == {"p2prl.procs", "p2prl.cli", "p2prl.algo"}
    finally:
        del MODULES["p2prl._layout_probe"]
    tree = ast.parse("import logging\nlogging.getLogger(__name__)\nlogging.getLogger('hivemind.dht')\n"
                     "logging.getLogger('p2prl.node')\nlogging.getLogger(NAME)\n")
    MODULES["p2prl._layout_probe"] = (PACKAGE / "_layout_probe.py", tree)
    try:
        assert [u for u in foreign_loggers() if u.startswith("p2prl._layout_probe")] == [
            "p2prl._layout_probe:4: logging.getLogger('p2prl.node')", "p2prl._layout_probe:5: logging.getLogger(NAME)"]
    finally:
        del MODULES["p2prl._layout_probe"]
    tree = ast.parse("import p2prl.config as c\nfrom p2prl.procs import _x\nc._y\n")
    MODULES["p2prl._layout_probe"] = (PACKAGE / "_layout_probe.py", tree)
    try:
        assert sorted(u for u in private_uses() if u.startswith("p2prl._layout_probe")) == [
            "p2prl._layout_probe:2: imports _x from p2prl.procs",
            "p2prl._layout_probe:3: uses p2prl.config._y",
        ]
    finally:
        del MODULES["p2prl._layout_probe"]
    tree = ast.parse("node.transport.dht.get(k)\ntransport.p2p\ngetattr(node.transport, 'dht', None)\n"
                     "node.p2p\nself.transport.store(k)\n")
    MODULES["p2prl._layout_probe"] = (PACKAGE / "_layout_probe.py", tree)
    try:
        assert sorted(u for u in transport_internals() if u.startswith("p2prl._layout_probe")) == [
            "p2prl._layout_probe:1: node.transport.dht",
            "p2prl._layout_probe:2: transport.p2p",
            "p2prl._layout_probe:3: getattr(node.transport, 'dht', None)",
        ]
    finally:
        del MODULES["p2prl._layout_probe"]


def test_the_size_check_can_fail():
    def lines(n: int, indent: str) -> str:
        return "".join(f"{indent}x = {i}\n" for i in range(n))

    source = ("class C:\n    def short(self):\n        pass\n\n    def long(self):\n" + lines(60, " " * 8)
              + "\ndef fits():\n" + lines(59, " " * 4) + "\nclass Big:\n" + lines(300, " " * 4))
    MODULES["p2prl._layout_probe"] = (PACKAGE / "_layout_probe.py", ast.parse(source))
    try:
        assert [f for f in oversized() if f.startswith("p2prl._layout_probe")] == [
            "p2prl._layout_probe.C.long: 61 lines", "p2prl._layout_probe.Big: 301 lines"]
    finally:
        del MODULES["p2prl._layout_probe"]


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles among p2prl modules:\n  " + "\n  ".join(" -> ".join(c) for c in cycles)


def every_cycle(graph: dict[str, set[str]]) -> list[list[str]]:
    """``find_cycles`` until none is left, each round without the closing edge of every cycle found before, so
    that one cycle does not hide another in the same component: every cycle of ``graph`` goes through one of
    the closing edges of those listed."""
    graph, out = {v: set(ws) for v, ws in graph.items()}, []
    while cycles := find_cycles(graph):
        out += cycles
        for c in cycles:
            graph[c[-2]].discard(c[-1])
    return out


def test_no_import_cycles_through_lazy_imports():
    cycles = every_cycle(import_graph(lazy=True))
    assert not cycles, ("import cycles among p2prl modules, counting the imports inside functions:\n  "
                        + "\n  ".join(" -> ".join(c) for c in cycles))


def test_no_module_uses_another_modules_private_names():
    found = private_uses()
    assert not found, "private names used across p2prl modules:\n  " + "\n  ".join(found)


def test_nothing_reaches_past_the_transport_seam():
    found = transport_internals()
    assert not found, "a transport's hivemind objects used outside transport.py:\n  " + "\n  ".join(found)


def foreign_loggers() -> list[str]:
    """``module:line: getLogger(...)`` for every logger of p2prl's that is not its module's own: a module logs as
    ``logging.getLogger(__name__)``; ``getLogger()`` (the root) and other packages' loggers (hivemind's, named in
    the call or by a module-level constant) are not p2prl's."""
    found = []
    for name, (_, tree) in MODULES.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "getLogger" and node.args):
                continue
            arg = node.args[0]
            if isinstance(arg, ast.Name) and arg.id == "__name__":
                continue
            value = _string(arg, tree)
            if isinstance(value, str) and value.split(".")[0] != "p2prl":
                continue
            found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_every_module_logs_by_its_own_name():
    found = foreign_loggers()
    assert not found, "loggers not named by __name__:\n  " + "\n  ".join(found)


MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 60


def oversized() -> list[str]:
    """``module.Qualified.name: N lines`` for every class over ``MAX_CLASS_LINES`` lines and every function or method
    over ``MAX_FUNCTION_LINES`` (from its ``def`` or ``class`` line to its last line, docstring included)."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}.{child.name}"
                lines = child.end_lineno - child.lineno + 1
                limit = MAX_CLASS_LINES if isinstance(child, ast.ClassDef) else MAX_FUNCTION_LINES
                if lines > limit:
                    found.append(f"{name}: {lines} lines")
                visit(child, name)
            else:
                visit(child, prefix)

    for module, (_, tree) in MODULES.items():
        visit(tree, module)
    return found


def test_no_class_over_300_lines_and_no_function_over_60():
    found = oversized()
    assert not found, "too long:\n  " + "\n  ".join(found)


FLOORS = (
    # what the config tree is assembled from: the objectives (pure torch), the wire record and the admission rules
    ("algo", "rollout.record", "rollout.admission"),
    ("p2prl", "config", "log", "procs", "metrics", "prom"),  # plain Python: the config tree, logging, processes
    ("tasks",),  # the problems and their rewards
    ("policy", "rollout"),  # the model; the wire record and the learner's checks of it
    ("net", "trust"),  # the network (transport, records, streams, weights, rounds); whom a peer believes
    ("learner", "sampler", "ops"),  # the roles; the operator tools
    ("train", "launch", "experiments"),  # both roles in one process; local swarms; experiments
    ("cli",),
)
"""Floors of the package, bottom first, by top-level module or folder (or a module of one, which then stands apart
from its folder's floor): a module imports (lazily too) only from its own floor and those below."""
UPWARD = {
    ("p2prl.config", "p2prl.net.dht"),  # format_hostport, a plain helper that belongs on the bottom floor
    ("p2prl.prom", "p2prl.net.dht"),  # the same
    ("p2prl.policy.make_base", "p2prl.learner.evaluate"),  # the base builders' held-out check after training
    ("p2prl.policy.math_base", "p2prl.learner.evaluate"),  # the same
}
"""Known imports from a higher floor. This list must shrink to empty: add none."""


def _floor(module: str) -> int | None:
    """The floor of ``module``: that of the longest name in ``FLOORS`` it is or lies in."""
    name = module.split(".", 1)[1] if "." in module else "p2prl"
    for prefix in sorted({n for floor in FLOORS for n in floor}, key=len, reverse=True):
        if name == prefix or name.startswith(prefix + "."):
            return next(i for i, floor in enumerate(FLOORS) if prefix in floor)
    return None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``a -> b`` for every import of ``graph`` from a module to one on a higher floor, but those in ``UPWARD``."""
    return [f"{a} -> {b}" for a, targets in sorted(graph.items()) for b in sorted(targets)
            if _floor(b) > _floor(a) and (a, b) not in UPWARD]


def test_every_module_is_on_a_floor():
    assert not [m for m in MODULES if _floor(m) is None], "add the new folder to FLOORS"


def test_no_module_imports_from_a_higher_floor():
    found = upward_imports(import_graph(lazy=True))
    assert not found, "imports from a higher floor:\n  " + "\n  ".join(found)
    graph = import_graph(lazy=True)
    assert all(b in graph[a] for a, b in UPWARD), "remove from UPWARD what is no longer imported"
    assert upward_imports({"p2prl.net.node": {"p2prl.learner.loop", "p2prl.trust.owned"}}) == [
        "p2prl.net.node -> p2prl.learner.loop"]
