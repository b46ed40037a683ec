"""No public function of the planner takes more than 8 parameters: a search is asked with typed requests
(``planner.request.Machine``, ``SearchSpace``), not long keyword lists. Walks ``plait/planner`` with ``ast``:
public = a name not starting with ``_`` (methods of public classes too); ``self`` / ``cls`` not counted;
``*args`` and ``**kwargs`` count one each."""

from __future__ import annotations

import ast

from tests.helpers.jobs import ROOT

PLANNER = ROOT / "plait" / "planner"
LIMIT = 8


def _public_functions(tree: ast.AST, prefix: str = ""):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            yield prefix + node.name, node.args
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            yield from _public_functions(node, f"{prefix}{node.name}.")


def _count(args: ast.arguments) -> int:
    names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs if a.arg not in ("self", "cls")]
    return len(names) + (args.vararg is not None) + (args.kwarg is not None)


def test_no_public_planner_function_takes_more_than_eight_parameters():
    files = sorted(PLANNER.rglob("*.py"))
    assert len(files) > 20
    over = [f"{path.relative_to(ROOT)}: {name} ({_count(args)})"
            for path in files for name, args in _public_functions(ast.parse(path.read_text()))
            if _count(args) > LIMIT]
    assert not over, "public planner functions over 8 parameters: " + "; ".join(over)
