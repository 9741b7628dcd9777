"""The layout figures issue 19 reports, for any checkout: ``python tests/layout_figures.py [RECSYS_DIR]``.

Counts, each parsed from the source (``ast``), not grepped:
- loose top-level modules (``recsys/*.py`` besides ``__init__``);
- cycles between packages (and top-level modules) in the import graph;
- functions taking more than 7 parameters (``self``/``cls`` not counted);
- homes of the manifest: modules that name its file (``"_manifest.json"``) or open, parse or
  rewrite it outside ``recsys/manifest.py``;
- MLflow tag-name literals (``"recsys.*"`` / ``"mlflow.*"`` strings used as tag keys) outside the tags module;
- copies of the scoring settings: calls passing three or more ``scoring.*`` fields one by one.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import import_graph as ig

SCORING_FIELDS = {"chunk_size", "top_n", "dtype", "device", "max_tile_mb", "arrow_batch_size", "users_per_task",
                  "cache_size", "exclude_seen"}
TAG_PREFIXES = ("recsys.", "mlflow.note", "mlflow.data", "mlflow.experimentKind")
NOT_TAGS = ("recsys.log", "recsys.cli", "recsys.scoring", "recsys.pipelines", "recsys.data", "recsys.model")


def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
            names = [n for n in names if n not in ("self", "cls")]
            yield node, len(names)


def _handles_manifest(tree: ast.AST) -> bool:
    """Names the manifest's file in code (not a docstring), or defines a function about the manifest."""
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.body
                  and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and id(node) not in docstrings and isinstance(node.value, str) \
                and "_manifest.json" in node.value and not node.value.startswith(("could not", "the ")):
            return True
        if isinstance(node, ast.Name) and node.id == "MANIFEST_NAME":
            return True
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and "manifest" in node.name:
            return True
    return False


def figures(root: Path) -> dict[str, object]:
    mods = ig.modules(root)
    loose = sorted(m for m, p in mods.items() if m.count(".") == 1 and p.name != "__init__.py")
    long_params, manifest_homes, tag_literals, scoring_copies = [], set(), [], []
    for name, path in mods.items():
        text = path.read_text()
        tree = ast.parse(text)
        for fn, n in _functions(tree):
            if n > 7:
                long_params.append(f"{name}.{fn.name} ({n})")
        if name not in ("recsys.manifest", "recsys.data.contracts") and _handles_manifest(tree):
            manifest_homes.add(name)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(TAG_PREFIXES) \
                    and " " not in node.value and not node.value.startswith(NOT_TAGS) and not node.value.endswith(".py") \
                    and name != "recsys.tracking.tags":
                tag_literals.append(f"{name}:{node.lineno} {node.value}")
            if isinstance(node, ast.Call):
                copied = [k.arg for k in node.keywords
                          if k.arg in SCORING_FIELDS and isinstance(k.value, ast.Attribute) and k.value.attr == k.arg]
                if len(copied) >= 3:
                    scoring_copies.append(f"{name}:{node.lineno}")
    graph = ig.package_graph(ig.imports(root))
    return {
        "loose top-level modules": loose,
        "package cycles": ig.cycles(graph),
        "functions over 7 parameters": sorted(long_params),
        "homes of the manifest": sorted(manifest_homes),
        "tag-name literals": tag_literals,
        "copies of the scoring settings": scoring_copies,
    }


if __name__ == "__main__":
    root = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ig.ROOT
    for key, value in figures(root).items():
        print(f"{key}: {len(value)}")
        for item in value:
            print(f"    {item}")
