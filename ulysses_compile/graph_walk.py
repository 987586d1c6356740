"""Walks over an FX graph that passes and Inductor-side graph passes share."""

from __future__ import annotations

import re

import torch
import torch.fx as fx

# name parts of the ops that draw from a random generator (rand_like, randn, bernoulli_, log_normal_,
# aten's "bernoulli.p", dropout2d, gumbel_softmax, torch.distributions' _standard_gamma ...)
_RANDOM_PARTS = frozenset(("dropout", "dropout1d", "dropout2d", "dropout3d", "rand", "randn", "randint", "randperm",
                           "random", "bernoulli", "normal", "multinomial", "poisson", "binomial", "gamma",
                           "dirichlet", "gumbel", "rrelu", "uniform", "exponential", "cauchy", "geometric"))
_OFF_UNLESS_TRAINING = ("alpha", "rrelu")  # alpha_dropout, feature_alpha_dropout, rrelu: training=False by default


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
    """Whether ``node`` draws from a random generator: a random op, a dropout or ``rrelu`` that draws
    (``p`` not 0, training), scaled dot-product attention with ``dropout_p`` not 0. A ``p`` traced
    symbolic counts at its value in the call compiled."""
    if node.op not in ("call_function", "call_method"):
        return False
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    parts = set(re.split(r"[._]", name)) - {""}
    if name.endswith("scaled_dot_product_attention"):
        return _value(node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0)) != 0
    if "loss" in parts or not parts & _RANDOM_PARTS:  # (poisson_nll_loss)
        return False
    if "rrelu" in parts:
        return _value(node.kwargs.get("training", node.args[3] if len(node.args) > 3 else False)) is True
    if parts & {"dropout", "dropout1d", "dropout2d", "dropout3d"}:
        p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
        default = not any(word in parts for word in _OFF_UNLESS_TRAINING)
        training = node.kwargs.get("training", node.kwargs.get("train", node.args[2] if len(node.args) > 2 else default))
        return _value(p) != 0 and _value(training) is not False
    return True


def _value(argument):
    """A constant argument, or a traced one at its value in the call compiled."""
    from .compat import symbolic_hint  # (compat builds on this module)

    if not isinstance(argument, fx.Node):
        return argument
    value = argument.meta.get("example_value", argument.meta.get("val"))
    return symbolic_hint(value) if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)) else value
