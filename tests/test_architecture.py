"""The import graph of caote/ has no cycle (parsed with ast: module-level and function-level imports alike), and
importing a module of caote loads `caote.reports` only from the command bodies (module-level imports)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "caote"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The caote module ``name`` refers to: itself, else the longest known prefix (an attribute of a module)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def _module_level(node: ast.AST) -> list[ast.AST]:
    """The nodes run when the module is imported, in source order: every node outside function bodies."""
    nodes = [node]
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            nodes += _module_level(child)
    return nodes


def imports(module: str, path: Path, known: dict[str, Path], module_level: bool = False) -> list[tuple[str, int]]:
    """``(imported caote module, line)`` for every import in ``module``, wherever it sits (function bodies too; with
    ``module_level``, only those run when it is imported). In a module that calls ``import_module`` (there), every
    string naming a caote module counts as an import of it too."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    nodes = _module_level(tree) if module_level else list(ast.walk(tree))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    dynamic = any(
        isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
        for node in nodes
    )
    found = []
    for node in nodes:
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from caote.x import y` imports the submodule caote.x.y when there is one, else caote.x
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        elif dynamic and isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in known:
            names = [node.value]
        for name in names:
            target = _resolve(name, known) if name == "caote" or name.startswith("caote.") else None
            if target is not None and target != module:
                found.append((target, node.lineno))
    return found


def import_graph(module_level: bool = False) -> dict[str, dict[str, int]]:
    """``{module: {imported module: first line}}`` over every module of caote/ (`imports`)."""
    known = modules()
    graph: dict[str, dict[str, int]] = {}
    for module, path in known.items():
        edges: dict[str, int] = {}
        for target, line in imports(module, path, known, module_level):
            edges.setdefault(target, line)
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(graph):
        if state.get(root):
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            child = next(stack[-1], None)
            if child is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(child) == 1:
                return path[path.index(child) :] + [child]
            elif not state.get(child):
                state[child] = 1
                path.append(child)
                stack.append(iter(sorted(graph.get(child, {}))))
    return None


def reachable(graph: dict[str, dict[str, int]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for child in graph.get(todo.pop(), {}):
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return seen


def cyclic_groups(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or not (strongly connected, more than one)."""
    reach = {module: reachable(graph, module) for module in graph}
    groups = {
        tuple(sorted(m for m in reach[module] if module in reach[m])) for module in graph if module in reach[module]
    }
    return sorted(list(group) for group in groups)


def describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    steps = [
        f"  {source} imports {target} ({modules()[source].relative_to(PACKAGE.parent)}:{graph[source][target]})"
        for source, target in zip(cycle, cycle[1:])
    ]
    groups = "\n".join(f"  {', '.join(group)}" for group in cyclic_groups(graph))
    return (
        "import cycle in caote/: " + " -> ".join(cycle) + "\n" + "\n".join(steps) + "\n"
        "Every group of modules that import each other:\n" + groups + "\n"
        "Layers import only downward: move what the lower module needs below it (or the code that needs both "
        "above them); a deferred import inside a function does not break the cycle."
    )


def test_no_import_cycle():
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, describe(cycle, graph)


REPORTS = "caote.reports"
# the command bodies that import caote.reports at the top: each is imported inside its command function only
COMMAND_BODIES = ("caote.evaluation.report",)  # ``caote eval``, from caote.evaluation.cli.run


def import_chain(graph: dict[str, dict[str, int]], start: str, wanted) -> list[str] | None:
    """The shortest ``[start, ..., module]`` of imports from ``start`` to a module for which ``wanted`` holds."""
    parents, todo = {start: None}, [start]
    while todo:
        module = todo.pop(0)
        if module != start and wanted(module):
            chain = [module]
            while parents[chain[-1]] is not None:
                chain.append(parents[chain[-1]])
            return chain[::-1]
        for child in sorted(graph.get(module, {})):
            if child not in parents:
                parents[child] = module
                todo.append(child)
    return None


def test_only_the_command_bodies_load_the_reports():
    """caote's core, the computing side of caote.evaluation and caote.benchmark never load caote.reports when
    imported, directly or through what they import (caote/reports/__init__.py states the rule)."""
    graph = import_graph(module_level=True)

    def in_reports(module: str) -> bool:
        return module == REPORTS or module.startswith(f"{REPORTS}.")

    chains = [
        import_chain(graph, module, in_reports)
        for module in graph
        if not in_reports(module) and module not in COMMAND_BODIES
    ]
    found = [
        " -> ".join(chain) + f" ({modules()[chain[0]].relative_to(PACKAGE.parent)}:{graph[chain[0]][chain[1]]})"
        for chain in chains
        if chain is not None
    ]
    assert not found, (
        "modules that load caote.reports when imported:\n  " + "\n  ".join(found) + "\n"
        "Only the command bodies (COMMAND_BODIES) import caote.reports at the top; a command imports them inside its "
        "command function."
    )
    stale = [body for body in COMMAND_BODIES if not any(in_reports(module) for module in graph[body])]
    assert not stale, f"COMMAND_BODIES names modules that no longer import caote.reports: {stale}"


def test_the_graph_sees_deferred_and_dynamic_imports(tmp_path):
    source = tmp_path / "module.py"
    source.write_text(
        "import importlib\n"
        "from caote.x import helper\n"
        "from caote import y\n"
        "def later():\n"
        "    import caote.z.w\n"
        "COMMANDS = ('caote.v',)\n"
        "def load(name):\n"
        "    return importlib.import_module(name)\n"
    )
    known = {name: source for name in ("caote", "caote.x", "caote.y", "caote.z", "caote.v", "caote.me")}
    found = sorted(target for target, _ in imports("caote.me", source, known))
    assert found == ["caote.v", "caote.x", "caote.y", "caote.z"]
    at_import = sorted(target for target, _ in imports("caote.me", source, known, module_level=True))
    assert at_import == ["caote.x", "caote.y"]


def test_find_cycle():
    made_up = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    assert find_cycle(made_up) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": 1}, "b": {}}) is None
    assert cyclic_groups(made_up) == [["a", "b", "c"]]


def test_one_usage_error_class():
    defined = [
        f"{module}:{node.lineno}"
        for module, path in modules().items()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ClassDef) and node.name == "UsageError"
    ]
    assert len(defined) == 1, f"UsageError is defined {len(defined)} times: {defined}"


# -- the recipes of docs/architecture.md, tried as written -----------------------------------------------------------

RECIPES = PACKAGE.parent / "docs" / "architecture.md"


def test_the_add_a_policy_recipe_runs_as_written(monkeypatch):
    """The worked example of docs/architecture.md's "Add a policy": its score function and its registry entry, taken
    from the doc's code block, give a policy that parses (with +caote), is listed and evicts in stock generate."""
    import re
    import types

    import torch

    from caote import base_scores, bases, policies
    from caote.cache import EvictionCache
    from caote.testing import tiny_model

    recipe = RECIPES.read_text(encoding="utf-8").split("**Add a policy**", 1)[1].split("**Add a model family**", 1)[0]
    code = re.search(r"```python\n(.*?)```", recipe, re.S).group(1)
    function, _, entry = code.partition("# caote/bases.py")
    scores = types.SimpleNamespace(**vars(base_scores))
    exec(function, {"torch": torch}, vars(scores))  # step 1: the score function, as if in caote/base_scores.py
    entry = entry.split("\n", 1)[1]
    base = eval(entry, {**vars(bases), "base_scores": scores})  # step 2: the entry, in caote/bases.py's names
    monkeypatch.setitem(bases.BASE_SCORES, base.name, base)  # its place in register(...)
    assert {base.name, f"{base.name}+caote", f"{base.name}+fastcaote"} <= set(policies.policy_names())
    policy = policies.parse_policy(f"{base.name}+caote")
    assert policy.base is base and policy.value_aware
    model = tiny_model("llama")
    ids = torch.randint(3, 96, (1, 80), generator=torch.Generator().manual_seed(0))
    with EvictionCache(model, budget=24, policy=policy.name, block_size=16) as cache, torch.no_grad():
        model.generate(ids, cache=cache, prefill_chunk_size=16, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert cache.stats().tokens_kept == 24 and cache.stats().tokens_evicted == 80 + 5 - 24
