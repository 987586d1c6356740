"""Which ops of a graph draw from a random generator, and what they draw.

An op of a Dynamo graph is told by the parts of its name (``torch.rand``, ``x.uniform_()``,
``torch.bernoulli``, ``F.dropout2d``, ``F.gumbel_softmax``, torch.distributions' ``_standard_gamma``
...), so a function and a method are told alike; a dropout or ``rrelu`` draws only while training with
``p`` not 0, an attention kernel only with ``dropout_p`` not 0; a loss, a backward or a gradient of a
random op draws nothing. An argument that ``dynamic=True`` made symbolic counts at its value in the
call compiled.
"""

from __future__ import annotations

import inspect
import re

import torch
import torch.fx as fx

from ulysses_compile.core.compat import symbolic_hint
from ulysses_compile.core.runtime import attention_heads_dropout, flash_attention, flash_attention_varlen

_RANDOM_PARTS = frozenset(("dropout", "dropout1d", "dropout2d", "dropout3d", "rand", "randn", "randint", "randperm",
                           "random", "bernoulli", "normal", "multinomial", "poisson", "binomial", "gamma",
                           "dirichlet", "gumbel", "rrelu", "uniform", "exponential", "cauchy", "geometric"))
_DROPOUT_PARTS = frozenset(("dropout", "dropout1d", "dropout2d", "dropout3d"))


def random_draw(node: fx.Node) -> str | None:
    """What ``node`` draws ("dropout p=0.1", "rand_like", "attention dropout p=0.1"), None where it draws
    nothing."""
    if node.op not in ("call_function", "call_method"):
        return None
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    parts = set(re.split(r"[._]", name)) - {""}
    if node.target in (flash_attention, flash_attention_varlen):
        return _kernel_dropout(inspect.signature(node.target).bind(*node.args, **node.kwargs).arguments["dropout_p"])
    if name.split(".")[0] == "scaled_dot_product_attention" or node.target is attention_heads_dropout:
        return _kernel_dropout(node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0))
    if parts & {"loss", "backward", "grad"} or not parts & _RANDOM_PARTS:  # (poisson_nll_loss, _dirichlet_grad)
        return None
    if "rrelu" in parts:
        training = node.kwargs.get("training", node.args[3] if len(node.args) > 3 else False)
        return name if value_at_compile(training) is True else None
    if parts & _DROPOUT_PARTS:
        p = value_at_compile(node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5))
        default = "alpha" not in parts  # alpha_dropout, feature_alpha_dropout: training=False by default
        training = node.kwargs.get("training", node.kwargs.get("train", node.args[2] if len(node.args) > 2 else default))
        return f"{name} p={p}" if p != 0 and value_at_compile(training) is not False else None
    return name


def _kernel_dropout(dropout_p) -> str | None:
    p = value_at_compile(dropout_p)
    return None if p == 0 else f"attention dropout p={p}"


def value_at_compile(argument):
    """A constant argument, or a traced one at its value in the call compiled."""
    if not isinstance(argument, fx.Node):
        return argument
    value = argument.meta.get("example_value", argument.meta.get("val"))
    return symbolic_hint(value) if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)) else value
