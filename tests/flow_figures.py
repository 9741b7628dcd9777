"""The data-flow figures of issue 32, for any checkout: ``python tests/flow_figures.py [RECSYS_DIR]``.

Counted on the parsed source (``ast``), not grepped:

- **module switches in the night's ``_run``** (``recsys/pipelines/nightly.py``): the calls in ``_run``'s
  body, in source order (an outer call before the calls in its arguments, as a reader meets them), each
  resolved to the module its callee lives in through the module's imports: ``stages.score(...)`` to
  ``recsys.pipelines.nightly_stages``, ``publish(...)`` imported from ``recsys.publish.publisher`` to that
  module, a function or class of ``nightly.py`` itself to ``recsys.pipelines.nightly``. Only callees in
  ``recsys`` count; builtins, the standard library and methods of values (``timer.stage``, ``c.update``,
  ``recorder.log_params``) do not. A switch is two consecutive counted calls whose modules differ.
- **fields typed ``Any``** in the night's stage records: the annotated fields of every class in
  ``nightly_stages``, ``nightly_compare`` and ``nightly`` whose annotation names ``Any`` anywhere
  (``Any``, ``Mapping[str, Any]``, ``dict[str, Any] | None``).
- **functions over 7 parameters** in ``recsys/`` (``self``/``cls`` not counted; ``*args``/``**kwargs``
  count one each), except argument parsers: functions whose body calls ``add_argument`` or ``add_parser``
  (their parameters mirror a command line).
"""
from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "recsys"
NIGHT = "recsys.pipelines.nightly"
STAGE_RECORD_MODULES = ("recsys.pipelines.nightly", "recsys.pipelines.nightly_stages", "recsys.pipelines.nightly_compare")
MAX_PARAMETERS = 7


def _module_path(root: Path, module: str) -> Path | None:
    parts = module.split(".")
    if parts[0] != "recsys":
        return None
    base = root.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _tree(root: Path, module: str) -> ast.Module:
    path = _module_path(root, module)
    if path is None:
        raise FileNotFoundError(f"{module} not found under {root}")
    return ast.parse(path.read_text())


def _names(root: Path, module: str, tree: ast.Module) -> dict[str, str]:
    """Name bound at module level -> the module its object lives in ('' for what is not in recsys)."""
    out: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                out[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out[alias.asname or alias.name] = sub if _module_path(root, sub) else node.module
    return out


def _function(tree: ast.Module, name: str) -> ast.FunctionDef:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise LookupError(f"no function {name}")


def _callee_module(call: ast.Call, names: dict[str, str], local: set[str]) -> str | None:
    node = call.func
    while isinstance(node, ast.Attribute):
        node = node.value
    if not isinstance(node, ast.Name) or node.id in local:
        return None
    module = names.get(node.id, "")
    return module if module == "recsys" or module.startswith("recsys.") else None


@dataclass(frozen=True)
class Switches:
    calls: list[tuple[int, str, str]]     # (line, callee as written, module)

    @property
    def switches(self) -> int:
        modules = [m for _, _, m in self.calls]
        return sum(1 for a, b in zip(modules, modules[1:]) if a != b)

    def between(self, a: str, b: str) -> int:
        modules = [m for _, _, m in self.calls]
        return sum(1 for x, y in zip(modules, modules[1:]) if {x, y} == {a, b})


def run_switches(root: Path = ROOT, module: str = NIGHT, function: str = "_run") -> Switches:
    """The counted calls of ``module.function`` in source order, with the module of each callee."""
    tree = _tree(root, module)
    names = _names(root, module, tree)
    fn = _function(tree, function)
    local = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            local.add(node.id)
        elif isinstance(node, ast.withitem) and isinstance(node.optional_vars, ast.Name):
            local.add(node.optional_vars.id)
    calls = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            where = _callee_module(node, names, local)
            if where is not None:
                calls.append((node.lineno, node.col_offset, ast.unparse(node.func), where))
    calls.sort()
    return Switches([(line, name, where) for line, _, name, where in calls])


def any_fields(root: Path = ROOT, modules: tuple[str, ...] = STAGE_RECORD_MODULES) -> list[str]:
    """``module.Class.field: annotation`` for every class field whose annotation names ``Any``."""
    found = []
    for module in modules:
        for node in ast.walk(_tree(root, module)):
            if not isinstance(node, ast.ClassDef):
                continue
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    mentioned = {n.id for n in ast.walk(item.annotation) if isinstance(n, ast.Name)}
                    mentioned |= {n.attr for n in ast.walk(item.annotation) if isinstance(n, ast.Attribute)}
                    text = ast.unparse(item.annotation)
                    if "Any" in mentioned or (isinstance(item.annotation, ast.Constant) and "Any" in str(text)):
                        found.append(f"{module}.{node.name}.{item.target.id}: {text}")
    return found


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    args = fn.args
    names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs if a.arg not in ("self", "cls")]
    return len(names) + (args.vararg is not None) + (args.kwarg is not None)


def _is_argument_parser(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
               and n.func.attr in ("add_argument", "add_parser") for n in ast.walk(fn))


def long_functions(root: Path = ROOT, limit: int = MAX_PARAMETERS) -> list[str]:
    """``module.function (n)`` for every function of ``root`` taking more than ``limit`` parameters."""
    found = []
    for path in sorted(root.rglob("*.py")):
        module = ".".join(("recsys",) + path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_argument_parser(node):
                n = _parameters(node)
                if n > limit:
                    found.append(f"{module}.{node.name} ({n})")
    return found


if __name__ == "__main__":
    root = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT
    night = run_switches(root)
    print(f"calls in {NIGHT}._run: {len(night.calls)}; module switches: {night.switches} "
          f"({night.between('recsys.pipelines.nightly_stages', 'recsys.pipelines.nightly_compare')} between "
          f"nightly_stages and nightly_compare)")
    previous = None
    for line, name, where in night.calls:
        print(f"    {line:4d} {'|' if where == previous else '>'} {name:32s} {where}")
        previous = where
    fields = any_fields(root)
    print(f"fields typed Any in the stage records: {len(fields)}")
    for item in fields:
        print(f"    {item}")
    long = long_functions(root)
    print(f"functions over {MAX_PARAMETERS} parameters (argument parsers aside): {len(long)}")
    for item in long:
        print(f"    {item}")
