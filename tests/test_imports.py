"""The package's import structure: no module imports itself back through others, and the API's validation
of a structured-output request loads no torch of specserve's own doing.

The graph holds every `import specserve...` / `from specserve... import` / relative import in a module, at
module level and inside functions alike (a function-level import that closes a circle is the same circle,
deferred to the first call: the one sampling_params -> structured -> sequence -> sampling_params went that
way), but not those under `if TYPE_CHECKING:`, which never run.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import specserve

ROOT = Path(specserve.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: the bodies of `if TYPE_CHECKING:` are left out."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the specserve modules it imports. `from pkg import name` is an edge to pkg.name where that
    is a module, else to pkg."""
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in paths)
                continue
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != ROOT.name:
                continue
            for alias in node.names:
                child = f"{target}.{alias.name}"
                edges.add(child if child in paths else target)
        edges.discard(name)
        graph[name] = {e for e in edges if e in paths}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_graph_sees_every_kind_of_import():
    graph = import_graph()
    assert "specserve.engine.scheduler" in graph["specserve.engine.llm_engine"]  # module level, absolute
    assert "specserve.engine.llm" in graph["specserve"]  # inside a function (the lazy __getattr__)
    assert "specserve.blockmgr.block_manager" in graph["specserve.blockmgr"]  # relative, `from .x import`


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_find_cycle_reports_the_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


# Run in a fresh interpreter: validates requests as the API does (the body's checks, then the grammar pool),
# and fails if torch is ever imported in this process, naming the modules on the stack that imported it.
API_VALIDATION = textwrap.dedent(
    """
    import asyncio
    import json
    import sys

    class NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch":
                stack, frame = [], sys._getframe(1)
                while frame is not None:
                    stack.append(frame.f_globals.get("__name__", ""))
                    frame = frame.f_back
                raise ImportError("torch imported by " + " <- ".join(stack))
            return None

    sys.meta_path.insert(0, NoTorch())

    import specserve.service.api  # the native and the OpenAI routes, and the gateway they share
    from specserve.service.config import ApiSettings
    from specserve.service.gateway import Gateway
    from specserve.service.http import ApiError

    async def main():
        gateway = Gateway(None, None, ApiSettings(prepare_workers=1, prepare_timeout_s=60.0))
        try:
            async def check(data):
                await gateway.prepare(gateway.validate(data))

            await check({"prompt": "x", "max_tokens": 4, "temperature": 0.5, "stop": ["."]})
            schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
            for constraint in ({"json": schema}, {"regex": "[a-z]{2,4}"}, {"choice": ["red", "green"]}):
                await check({"prompt": "x", "max_tokens": 4, "structured_outputs": constraint})
            bad = (
                ({"regex": "a(b"}, "structured_outputs.regex"),
                ({"grammar": "root ::= nothing"}, "structured_outputs.grammar"),
                ({"json": {"type": "object", "required": 3}}, "structured_outputs.json"),
                ({"choice": []}, "structured_outputs.choice"),
            )
            for constraint, field in bad:
                try:
                    await check({"prompt": "x", "structured_outputs": constraint})
                except ApiError as e:
                    assert e.status == 400 and e.param == field, (e.status, e.param, field)
                else:
                    raise AssertionError(f"{constraint} was accepted")
        finally:
            gateway.close()

    asyncio.run(main())
    assert "torch" not in sys.modules and "xgrammar" not in sys.modules
    print(json.dumps("ok"))
    """
)


def test_api_validation_imports_no_torch():
    """xgrammar 0.2 imports torch when it is imported, so the API builds no grammar itself: its grammar
    pool's children do (engine/prepare.py). The API process validates well-formed and bad constraints alike,
    bad ones refused naming their field, and torch (and xgrammar) never enter it."""
    run = subprocess.run(
        [sys.executable, "-c", API_VALIDATION], capture_output=True, text=True, timeout=180, cwd=ROOT.parent
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == '"ok"'
