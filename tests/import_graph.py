"""The package's import graph, parsed (not grepped), and the layer rules it must keep.

Every ``import`` and ``from ... import`` in every module of ``recsys/`` counts, those inside
functions and under ``TYPE_CHECKING`` included: a lazy import is still a dependency. Used by
``tests/test_architecture.py``; run it as a script to print the graph's figures
(``python tests/import_graph.py``). docs/architecture.md explains the layers.
"""
from __future__ import annotations

import ast
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "recsys"

# Layers, lowest first. An entry names a module, or a package and every module in it; a module belongs to the
# longest entry that names it. ``recsys`` is the package's own __init__ only: a new top-level module or package
# is in no layer until it is listed here (and in docs/architecture.md, whose diagram a test compares with this).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("recsys", "recsys.config", "recsys.errors", "recsys.uris", "recsys.redaction", "recsys.fs",
              "recsys.storage", "recsys.hooks", "recsys.conditional", "recsys.logs", "recsys.processes",
              "recsys.sequences")),
    ("core", ("recsys.model", "recsys.scoring.core", "recsys.data.partitions", "recsys.scoring.checks", "recsys.scoring.cache",
              "recsys.scoring.compare",
              "recsys.scoring.params",
              "recsys.data.contracts", "recsys.export.encoding")),
    ("glue", ("recsys.data", "recsys.scoring", "recsys.spark", "recsys.publish", "recsys.tracking",
              "recsys.learning", "recsys.export")),
    ("pipelines", ("recsys.pipelines", "recsys.evaluation")),
    ("entry", ("recsys.cli", "recsys.serve", "recsys.bench")),
)
RANK = {name: i for i, (name, _) in enumerate(LAYERS)}

# Imports that go up a layer on purpose, each with its reason.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {
    ("recsys.config", "recsys.model.configs"):
        "the model's config dataclasses (plain, no torch) are the one definition of valid hyperparameters",
}

# Within the glue layer, which package may use which; any other pair is a sideways import.
GLUE_MAY_USE: dict[str, frozenset[str]] = {
    "recsys.data": frozenset(),
    "recsys.spark": frozenset(),
    "recsys.learning": frozenset({"recsys.data"}),        # training shards: the histories built as the job builds them
    "recsys.scoring": frozenset({"recsys.spark"}),          # shipping the model files through the session
    "recsys.publish": frozenset({"recsys.spark"}),
    "recsys.tracking": frozenset(),
    "recsys.export": frozenset(),                           # Redis and its writing job; the pipeline brings the rest
}
# Within the top two layers: pipelines and evaluation never import each other; the frontend never imports the CLI.
SIDEWAYS_FORBIDDEN: frozenset[tuple[str, str]] = frozenset({
    ("recsys.pipelines", "recsys.evaluation"), ("recsys.evaluation", "recsys.pipelines"),
    ("recsys.serve", "recsys.cli"), ("recsys.bench", "recsys.cli"), ("recsys.bench", "recsys.serve"),
})
# Third-party packages a layer must not import: the core runs on a bare GPU box (torch, numpy, pyarrow
# only), and base utilities know no Spark.
FORBIDDEN_THIRD_PARTY: dict[str, tuple[str, ...]] = {
    "base": ("pyspark", "mlflow", "torch"),
    "core": ("pyspark", "mlflow", "pandas"),
}
# Modules outside the core that must run where the core runs (the GPU bench).
CORE_ONLY_MODULES = ("recsys.bench.core_bench", "recsys.bench.shapes")
CORE_MAY_NOT_IMPORT = ("recsys.config",)   # the core knows no configuration object


@dataclass(frozen=True)
class Import:
    source: str      # importing module
    target: str      # imported module (recsys.*) or top-level third-party package
    line: int


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def imports(root: Path = ROOT) -> list[Import]:
    """Every import of every module under ``root``, resolved to a module name."""
    known = modules(root)
    found: list[Import] = []
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                found += [Import(name, _resolve(a.name, known), node.lineno) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                for alias in node.names:   # ``from recsys import fs`` imports the module recsys.fs
                    candidate = f"{base}.{alias.name}"
                    found.append(Import(name, _resolve(candidate if candidate in known else base, known), node.lineno))
    return found


def _resolve(target: str, known: dict[str, Path]) -> str:
    if target.split(".")[0] != "recsys":
        return target.split(".")[0]
    while target not in known and "." in target:
        target = target.rpartition(".")[0]
    return target


def _names(entry: str, module: str) -> bool:
    """Whether a LAYERS entry names ``module``: itself, or (any entry but the root package) a module inside it."""
    return module == entry or (entry != ROOT.name and module.startswith(entry + "."))


def layer_of(module: str) -> str:
    best = ("", "")
    for layer, prefixes in LAYERS:
        for prefix in prefixes:
            if _names(prefix, module) and len(prefix) > len(best[1]):
                best = (layer, prefix)
    if not best[0]:
        raise LookupError(f"{module} is in no layer: add it to LAYERS in tests/import_graph.py "
                          f"and to the diagram of docs/architecture.md")
    return best[0]


def unplaced(root: Path = ROOT) -> list[str]:
    """The modules under ``root`` that are in no layer."""
    out = []
    for module in modules(root):
        try:
            layer_of(module)
        except LookupError:
            out.append(module)
    return out


def stale_entries(root: Path = ROOT) -> list[str]:
    """Module names the rules list (layers, allowed edges, glue pairs, ...) that name no module or package."""
    known = modules(root)
    listed = {prefix for _, prefixes in LAYERS for prefix in prefixes}
    listed |= {name for pair in ALLOWED_UPWARD for name in pair} | {name for pair in SIDEWAYS_FORBIDDEN for name in pair}
    listed |= set(GLUE_MAY_USE) | {name for names in GLUE_MAY_USE.values() for name in names}
    listed |= set(CORE_ONLY_MODULES) | set(CORE_MAY_NOT_IMPORT)
    return sorted(name for name in listed if name not in known)


def package_of(module: str) -> str:
    """``recsys.X`` for modules of a subpackage; a top-level module is its own node."""
    parts = module.split(".")
    return ".".join(parts[:2])


def violations(found: list[Import] | None = None) -> list[str]:  # noqa: C901 (one rule per branch)
    """Every import that breaks a layer rule, as 'module:line imports target: why'."""
    found = imports() if found is None else found
    out = []
    for imp in found:
        src_layer = layer_of(imp.source)
        where = f"{imp.source}:{imp.line} imports {imp.target}"
        if not imp.target.startswith("recsys"):
            banned = FORBIDDEN_THIRD_PARTY.get(src_layer, ())
            if imp.source in CORE_ONLY_MODULES:
                banned = FORBIDDEN_THIRD_PARTY["core"]
            if imp.target in banned:
                out.append(f"{where}: the {src_layer} layer must not depend on {imp.target}")
            continue
        if imp.target == imp.source:
            continue
        dst_layer = layer_of(imp.target)
        if RANK[dst_layer] > RANK[src_layer] and (imp.source, imp.target) not in ALLOWED_UPWARD:
            out.append(f"{where}: upward, from {src_layer} to {dst_layer}")
            continue
        if (src_layer == "core" or imp.source in CORE_ONLY_MODULES) and imp.target in CORE_MAY_NOT_IMPORT:
            out.append(f"{where}: the core knows no configuration object")
        if imp.source in CORE_ONLY_MODULES and RANK[dst_layer] > RANK["core"]:
            out.append(f"{where}: {imp.source} runs where only the core does")
        src_pkg, dst_pkg = package_of(imp.source), package_of(imp.target)
        if src_pkg == dst_pkg:
            continue
        if src_layer == dst_layer == "glue" and dst_pkg not in GLUE_MAY_USE.get(src_pkg, frozenset()):
            out.append(f"{where}: sideways between glue packages ({src_pkg} may use "
                       f"{', '.join(sorted(GLUE_MAY_USE.get(src_pkg, ()))) or 'no other glue package'})")
        if (src_pkg, dst_pkg) in SIDEWAYS_FORBIDDEN:
            out.append(f"{where}: sideways, {src_pkg} must not use {dst_pkg}")
    return out


def package_graph(found: list[Import] | None = None) -> dict[str, set[str]]:
    found = imports() if found is None else found
    graph: dict[str, set[str]] = defaultdict(set)
    for imp in found:
        if imp.target.startswith("recsys") and package_of(imp.source) != package_of(imp.target):
            graph[package_of(imp.source)].add(package_of(imp.target))
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one package (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(set(graph) | {n for deps in graph.values() for n in deps}):
        if node not in index:
            visit(node)
    return found


if __name__ == "__main__":
    graph = package_graph()
    top_level = [m for m, p in modules().items() if m.count(".") == 1 and p.name != "__init__.py"]
    print(f"top-level modules: {len(top_level)} ({', '.join(sorted(m.split('.')[1] for m in top_level))})")
    print(f"package cycles: {cycles(graph) or 'none'}")
    bad = violations()
    print(f"layer violations: {len(bad)}")
    for line in bad:
        print("  " + line)
    loose, stale = unplaced(), stale_entries()
    print(f"modules in no layer: {', '.join(loose) or 'none'}; listed but missing: {', '.join(stale) or 'none'}")
    sys.exit(1 if bad or cycles(graph) or loose or stale else 0)
