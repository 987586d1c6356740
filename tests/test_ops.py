"""The one table of ops (``ulysses_compile/core/ops.py``): every spelling of an op is derived from its ATen
name, elementwise coverage is derived from ATen's ``pointwise`` tag, and the rules and the detection
passes read that table."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from ulysses_compile.core import ops
from ulysses_compile.passes.attention_forms import handwritten
from ulysses_compile.core.fx_graph import mutated_arg
from ulysses_compile.passes.rules import rule_for
from ulysses_compile.passes.rules.pointwise import CAST_LIKE, cast_like_rule, pointwise
from ulysses_compile.core.sharding import REPLICATE, Shard

from test_rules import B, H, S, build, decide, empty


def _node(target) -> fx.Node:
    graph = fx.Graph()
    return graph.create_node("call_method" if isinstance(target, str) else "call_function", target,
                             (graph.placeholder("x"),))


def test_spellings_are_derived_from_the_aten_name():
    assert set(ops.spellings("add", in_place=True)) == {
        torch.add, "add", "add_", "__add__", "__iadd__", operator.add, operator.iadd}
    assert set(ops.spellings("div")) >= {torch.div, "div", operator.truediv, "__truediv__"}
    assert set(ops.spellings("softmax")) == {torch.softmax, torch.special.softmax, F.softmax, "softmax"}
    assert ops.spellings("special_entr") == (torch.special.entr,)
    assert ops.spellings("linear") == (F.linear,)
    assert "cumsum_" not in ops.spellings("cumsum")  # in-place variants only when asked for


def test_elementwise_ops_are_the_ones_aten_tags_pointwise_less_draws_and_reductions():
    names = ops.pointwise_names()
    assert {"hypot", "logaddexp", "sigmoid", "where", "copysign", "special_entr", "gelu"} <= set(names)
    assert not {"max", "min", "bernoulli", "rrelu", "dropout", "softmax", "sum"} & set(names)


@pytest.mark.parametrize("name", ops.pointwise_names())
def test_every_spelling_of_an_elementwise_op_reaches_the_pointwise_rule(name):
    """Adding an op to the table (or ATen tagging one) adds each of its spellings to the rule."""
    for target in ops.spellings(name, in_place=True):
        assert rule_for(_node(target)) is (cast_like_rule if target in CAST_LIKE else pointwise), target


def test_an_op_no_rule_names_is_sharded_like_any_elementwise_op():
    """``hypot`` is listed nowhere in the rules: its tag alone makes each spelling elementwise."""
    for target in ops.spellings("hypot", in_place=True):
        node, (x, weight) = build(target, empty(B, S, H), empty(H))
        decision = decide(node, {x: Shard(1)})
        assert decision.output == Shard(1) and decision.inputs == {x: Shard(1), weight: REPLICATE}, target


def test_the_detection_passes_read_the_same_table():
    assert set(handwritten.SOFTMAX) == set(ops.spellings("softmax"))
    assert set(ops.spellings("matmul", "bmm")) <= set(handwritten.SCORES) & set(handwritten.VALUES)


@pytest.mark.parametrize("target", sorted(ops.in_place_operators(), key=str))
def test_in_place_operators_and_their_methods_write_their_first_operand(target):
    graph = fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    node = graph.create_node("call_method" if isinstance(target, str) else "call_function", target, (x, y))
    assert mutated_arg(node) is x
