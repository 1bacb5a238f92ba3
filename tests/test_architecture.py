"""The import graph of caote/ has no cycle (parsed with ast: module-level and function-level imports alike)."""

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


def imports(module: str, path: Path, known: dict[str, Path]) -> list[tuple[str, int]]:
    """``(imported caote module, line)`` for every import in ``module``, wherever it sits (function bodies too). In a
    module that calls ``import_module``, every string naming a caote module counts as an import of it too."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    dynamic = any(
        isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
        for node in ast.walk(tree)
    )
    found = []
    for node in ast.walk(tree):
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


def import_graph() -> dict[str, dict[str, int]]:
    """``{module: {imported module: first line}}`` over every module of caote/."""
    known = modules()
    graph: dict[str, dict[str, int]] = {}
    for module, path in known.items():
        edges: dict[str, int] = {}
        for target, line in imports(module, path, known):
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
