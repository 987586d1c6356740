"""The package's own rules, read off its source: three layers imported one way (the front doors, the
passes, the core they build on), private torch APIs only through compat, placements written by one
function, collectives created by the passes that own them, no import-time effects."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted(ROOT.joinpath("ulysses_compile").rglob("*.py"))


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


@pytest.mark.parametrize("path", SOURCES, ids=lambda path: str(path.relative_to(ROOT)))
def test_private_torch_modules_are_imported_only_by_compat(path):
    if path.name == "compat.py":
        return
    private = [f"line {node.lineno}: {name}" for node in ast.walk(_tree(path))
               for name in _imported(node) if any(part.startswith("_") for part in name.split(".")[1:])
               and name.startswith(("torch", "functorch"))]
    assert not private, f"{path.name} imports private torch modules; go through compat.py: {private}"


LAYERS = ("ulysses_compile.core", "ulysses_compile.passes", "ulysses_compile")  # lowest first


def _layer(module: str) -> int:
    return next(index for index, layer in enumerate(LAYERS) if module == layer or module.startswith(f"{layer}."))


@pytest.mark.parametrize("path", SOURCES, ids=lambda path: str(path.relative_to(ROOT)))
def test_imports_go_one_way_from_the_front_doors_to_the_passes_to_the_core(path):
    """A module imports its own layer or a lower one, by absolute name; the core imports neither the
    passes nor the front doors, the passes not the front doors."""
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    tree = _tree(path)
    assert not [node.lineno for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level > 0], \
        f"{module} imports its siblings relatively: import them by absolute name"
    upward = [f"line {node.lineno}: {name}" for node in ast.walk(tree) for name in _imported(node)
              if name.startswith("ulysses_compile") and _layer(name) > _layer(module)]
    assert not upward, f"{module} imports a layer above its own: {upward}"


def _imported(node) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        return [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    return []


def test_placements_are_written_only_through_place():
    writers = [f"{path.relative_to(ROOT)}" for path in SOURCES if path.name != "sharding.py"
               and ("ulysses_sharding" in path.read_text() or "sharding._KEY" in path.read_text())]
    assert not writers, f"these modules touch the placement entry directly instead of sharding.place: {writers}"


# Which modules may create a call of each collective in a graph (collectives.insert_call).
CREATORS = {
    "ulysses_compile/passes/redistribute.py": {"scatter_seq", "gather_seq", "seq_to_heads", "reduce_partial", "sync_grad",
                                                "reblock_seq",
                               "add_previous_ranks_totals"},
    "ulysses_compile/passes/insert_all_to_all.py": {"seq_to_heads", "seq_to_heads_qkv", "heads_to_seq", "gather_kv_heads"},
    "ulysses_compile/passes/average_data_parallel_grads.py": {"average_grad"},
    "ulysses_compile/passes/rules/shape_ops.py": {"reblock_seq", "shift_seq", "rows_before"},
}


def test_collectives_are_created_by_the_passes_that_own_them():
    from ulysses_compile.core.collectives import COLLECTIVES

    names = {fn.__name__ for fn in COLLECTIVES} | {"scatter_seq"}
    for path in SOURCES:
        relative = str(path.relative_to(ROOT))
        if relative == "ulysses_compile/core/collectives.py":
            continue
        created = {call.args[1].id for call in ast.walk(_tree(path)) if isinstance(call, ast.Call)
                   and getattr(call.func, "id", None) == "insert_call" and isinstance(call.args[1], ast.Name)}
        assert created & names <= CREATORS.get(relative, set()), f"{relative} creates {sorted(created & names)}"


def test_importing_the_package_changes_nothing_in_torch():
    script = (
        "import torch, torch._logging._internal as logs, torch.optim.optimizer as optim, torch._dynamo.eval_frame as ef\n"
        "def state(): return (dict(logs.log_registry.log_alias_to_log_qnames), len(optim._global_optimizer_pre_hooks),\n"
        "                     ef.get_compiler_fn)\n"
        "before = state()\n"
        "import ulysses_compile\n"
        "after = state()\n"
        "assert before == after, (before, after)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_compat_only_reexports_and_shims():
    """compat.py holds torch's private names and thin shims over them (a few lines each), no class and
    nothing of the package: passes and their helpers live with the passes."""
    tree = _tree(ROOT / "ulysses_compile" / "core" / "compat.py")
    assert not [node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    assert not [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level > 0]
    longest = {node.name: sum(statement.end_lineno - statement.lineno + 1 for statement in node.body
                              if not (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)))
               for node in tree.body if isinstance(node, ast.FunctionDef)}
    assert max(longest.values()) <= 13, sorted(longest.items(), key=lambda item: -item[1])[:3]


def test_an_op_registered_twice_is_an_error_at_import():
    """Two sharding rules for one op would leave import order to pick one: ``register`` refuses the
    second (the package imports, so no op of it has two)."""
    from ulysses_compile.core.errors import InternalError
    from ulysses_compile.passes.rules import register, rule_for

    import torch.fx as fx

    graph = fx.Graph()
    node = graph.call_method("sin", (graph.placeholder("x"),))
    before = rule_for(node)
    with pytest.raises(InternalError, match="'sin' has two sharding rules, pointwise and .*register it once"):
        register("sin")(lambda node, view: None)
    assert rule_for(node) is before
