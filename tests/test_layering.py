"""Do poold's layers hold: no import circles, and no layer importing one above it?

Every module of the packages poold, agent and cli is parsed with `ast` (not
imported), and every import statement in it counts: at the top, inside functions,
under `if TYPE_CHECKING:`. Relative imports are resolved against the importing
module, and `from package import name` counts as an import of `package.name` when
that is a module, else of `package`. Imports of anything outside these packages
are left out. An edge goes to the module an import names, not to the packages
above it (their `__init__` runs too, but reporting each package's init in every
circle would hide the circle that matters).

The rules (STYLE.md, "Layers that don't leak"):

* no circle of imports between any of these modules;
* `poold.ledger` knows SQLAlchemy, not HTTP: nothing in it imports `poold.api`;
* `poold.wire` is the floor every side stands on: it imports nothing from
  `poold.ledger`, `poold.api`, `agent` or `cli`;
* the agent talks to poold over the wire: nothing in `agent` imports
  `poold.ledger` or `poold.api.app`.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("poold", "agent", "cli")

Graph = Mapping[str, frozenset[str]]


# --- reading the imports ----------------------------------------------------------


def module_files(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Dotted module name -> source file, for every module of `packages` under `root`."""
    found: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _known_prefix(name: str, known: frozenset[str]) -> str | None:
    """The longest leading part of dotted `name` that is one of our modules."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in known:
            return candidate
    return None


def imports_in(
    module: str, source: str, *, is_package: bool, known: frozenset[str]
) -> frozenset[str]:
    """The modules among `known` that `module`'s source imports, wherever the statement is."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source, filename=module)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _known_prefix(alias.name, known)
                if target is not None:
                    found.add(target)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                # `from . import x` in a package's __init__ means the package itself;
                # in a plain module it means the module's package.
                base = module.split(".") if is_package else module.split(".")[:-1]
                if node.level - 1 > len(base) - 1:
                    raise ValueError(f"{module}: relative import beyond the top package")
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join([*base, node.module] if node.module else base)
            else:
                stem = node.module or ""
            for alias in node.names:
                submodule = f"{stem}.{alias.name}"
                target = (
                    submodule
                    if alias.name != "*" and submodule in known
                    else _known_prefix(stem, known)
                )
                if target is not None:
                    found.add(target)
    found.discard(module)  # a package importing a name from itself is no circle
    return frozenset(found)


def import_graph(root: Path, packages: Iterable[str]) -> dict[str, frozenset[str]]:
    """Module -> the modules of these packages it imports."""
    files = module_files(root, packages)
    known = frozenset(files)
    return {
        module: imports_in(
            module, path.read_text(), is_package=path.name == "__init__.py", known=known
        )
        for module, path in files.items()
    }


# --- finding circles -----------------------------------------------------------------


def strongly_connected(graph: Graph) -> list[list[str]]:
    """Tarjan's components of more than one module (or one that imports itself), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component: list[str] = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(components)


def shortest_cycle(graph: Graph, start: str, members: Iterable[str]) -> list[str]:
    """The shortest chain start -> ... -> start through `members` (breadth first)."""
    allowed = set(members)
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for succ in sorted(graph.get(node, ())):
            if succ not in allowed:
                continue
            if succ == start:
                chain = [node]
                while chain[-1] != start:
                    chain.append(came_from[chain[-1]])
                return [*reversed(chain), start]
            if succ not in came_from:
                came_from[succ] = node
                queue.append(succ)
    raise ValueError(f"{start} is on no cycle within {sorted(allowed)}")


def cycles(graph: Graph) -> list[list[str]]:
    """One circle per tangle of mutually importing modules, each as a chain a -> ... -> a."""
    return [
        shortest_cycle(graph, component[0], component) for component in strongly_connected(graph)
    ]


def describe_cycles(graph: Graph) -> str:
    """Each circle as `a -> b -> a`, then the other modules tangled with it; "" if none."""
    lines = []
    for component, chain in zip(strongly_connected(graph), cycles(graph), strict=True):
        lines.append("  " + " -> ".join(chain))
        if len(component) > len(chain) - 1:
            lines.append(f"    (tangled with it: {', '.join(sorted(set(component) - set(chain)))})")
    return "\n".join(lines)


# --- the rules ------------------------------------------------------------------------


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@dataclass(frozen=True)
class Rule:
    """Nothing under `importer` imports anything under one of `forbidden`."""

    importer: str
    forbidden: tuple[str, ...]
    why: str

    def violations(self, graph: Graph) -> list[str]:
        return [
            f"{module} imports {target}"
            for module in sorted(graph)
            if within(module, self.importer)
            for target in sorted(graph[module])
            if any(within(target, f) for f in self.forbidden)
        ]


RULES = {
    "ledger_not_api": Rule("poold.ledger", ("poold.api",), "the ledger knows SQLAlchemy, not HTTP"),
    "wire_is_the_floor": Rule(
        "poold.wire",
        ("poold.ledger", "poold.api", "agent", "cli"),
        "the wire models are shared by every side, so they may depend on none of them",
    ),
    "agent_not_ledger_or_app": Rule(
        "agent",
        ("poold.ledger", "poold.api.app"),
        "the agent reaches poold over HTTP, never through its ledger or its app",
    ),
}


@pytest.fixture(scope="module")
def graph() -> dict[str, frozenset[str]]:
    return import_graph(ROOT, PACKAGES)


def test_every_package_is_read(graph: Graph) -> None:
    for module in ("poold.errors", "poold.ledger.leases", "poold.wire.common", "agent.server"):
        assert module in graph
    assert "cli.poolctl" in graph and "cli.common" in graph["cli.poolctl"]


def test_no_import_circles(graph: Graph) -> None:
    found = describe_cycles(graph)
    assert not found, f"import circles between modules:\n{found}"


@pytest.mark.parametrize("rule", RULES.values(), ids=RULES.keys())
def test_layers_do_not_leak(graph: Graph, rule: Rule) -> None:
    bad = rule.violations(graph)
    listed = "\n".join(f"  {line}" for line in bad)
    assert not bad, (
        f"{rule.importer} may not import {', '.join(rule.forbidden)} ({rule.why}):\n{listed}"
    )


# --- the checker checks itself, on made-up code -------------------------------------------


def test_imports_resolve_every_form() -> None:
    known = frozenset(
        {"pkg", "pkg.sub", "pkg.sub.leaf", "pkg.sub.other", "pkg.top", "pkg.typed", "pkg.lazy"}
    )
    source = """
import os
import pkg.sub.leaf
from pkg import top
from pkg.sub import other, some_name
from . import other as again
from ..sub.leaf import thing
from .missing import x
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from ..typed import Alias
def later():
    import pkg.lazy.not_a_module
"""
    # Itself (twice) is dropped, `some_name` and `.missing` fall back to pkg.sub, os is not ours.
    assert imports_in("pkg.sub.leaf", source, is_package=False, known=known) == {
        "pkg.top",
        "pkg.sub",
        "pkg.sub.other",
        "pkg.typed",
        "pkg.lazy",
    }
    # In a package's __init__, `.` is the package itself.
    in_init = "from . import leaf\nfrom .. import top\nfrom .other import *\n"
    assert imports_in("pkg.sub", in_init, is_package=True, known=known) == {
        "pkg.sub.leaf",
        "pkg.top",
        "pkg.sub.other",
    }
    with pytest.raises(ValueError, match="beyond the top package"):
        imports_in("pkg.top", "from .. import x\n", is_package=False, known=known)


def test_the_cycle_finder_finds_a_planted_cycle() -> None:
    planted: dict[str, frozenset[str]] = {
        "a": frozenset({"b"}),
        "b": frozenset({"c", "x"}),
        "c": frozenset({"a"}),
        "x": frozenset({"y"}),
        "y": frozenset(),
        "p": frozenset({"q"}),
        "q": frozenset({"p"}),
        "solo": frozenset({"solo"}),
    }
    assert strongly_connected(planted) == [["a", "b", "c"], ["p", "q"], ["solo"]]
    assert cycles(planted) == [["a", "b", "c", "a"], ["p", "q", "p"], ["solo", "solo"]]
    assert "a -> b -> c -> a" in describe_cycles(planted)
    acyclic = {name: deps - {"a", "p", "solo"} for name, deps in planted.items()}
    assert cycles(acyclic) == [] and describe_cycles(acyclic) == ""


def test_the_rules_catch_a_planted_leak() -> None:
    planted = {
        "poold.ledger.db": frozenset({"poold.api.client", "poold.apiary", "poold.wire.common"}),
        "poold.wire.common": frozenset({"cli.units"}),
        "agent.link": frozenset({"poold.api.client", "poold.api.app", "poold.apiary"}),
        "poold.api.client": frozenset(),
        "poold.api.app": frozenset({"poold.ledger.db"}),
        "poold.apiary": frozenset(),
        "cli.units": frozenset(),
    }
    assert RULES["ledger_not_api"].violations(planted) == [
        "poold.ledger.db imports poold.api.client"
    ]
    assert RULES["wire_is_the_floor"].violations(planted) == ["poold.wire.common imports cli.units"]
    assert RULES["agent_not_ledger_or_app"].violations(planted) == [
        "agent.link imports poold.api.app"
    ]
