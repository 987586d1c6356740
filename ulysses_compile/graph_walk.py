"""Walks over an FX graph that passes and Inductor-side graph passes share."""

from __future__ import annotations

import torch.fx as fx

# name parts of the ops that draw from a random generator (rand_like, randn, bernoulli_, log_normal_, ...)
_RANDOM_PARTS = frozenset(("dropout", "rand", "randn", "randint", "randperm", "bernoulli", "normal", "multinomial",
                           "poisson", "rrelu", "uniform", "exponential", "cauchy", "geometric"))


def ancestors(nodes) -> set[fx.Node]:
    """``nodes`` and every node they are computed from, graph inputs included."""
    pending = list(nodes)
    seen: set[fx.Node] = set()
    while pending:
        node = pending.pop()
        if node in seen:
            continue
        seen.add(node)
        pending.extend(node.all_input_nodes)
    return seen


def draws_random_numbers(node: fx.Node) -> bool:
    """Whether ``node`` draws from a random generator: a random op, a dropout that drops (``p`` not 0,
    ``training`` not False), an attention kernel with ``dropout_p`` not 0."""
    if node.op not in ("call_function", "call_method"):
        return False
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    dropout_p = node.kwargs.get("dropout_p", node.args[4] if "scaled_dot_product" in name and len(node.args) > 4 else 0)
    if dropout_p != 0:
        return True
    parts = set(name.strip("_").split("_"))
    if "dropout" in parts:
        p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
        training = node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True)
        return p != 0 and training is not False
    return bool(parts & _RANDOM_PARTS)
