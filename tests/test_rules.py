"""Each family of sharding rules, called directly on one op of a hand-built FX graph at P = 2: the
placement a rule gives the output and the placement it demands of each input, for a case it keeps
sharded, a case it completes or replicates, and a case it refuses (None: the op runs gathered). A rule
that changes its mind fails here, named, rather than somewhere inside a model."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from ulysses_compile.passes.rules import RuleView, rule_for
from ulysses_compile.core.runtime import attention_output, flash_attention, flash_attention_varlen
from ulysses_compile.core.sharding import (
    PARTIAL,
    REPLICATE,
    MergedShard,
    Partial,
    PartialScan,
    PermutedShard,
    Positions,
    Shard,
    is_permuted,
)

B, S, H = 2, 8, 4


def call(graph: fx.Graph, target, *args, **kwargs) -> fx.Node:
    """A node running ``target`` as Dynamo records it (a string is a method of the first argument),
    its example value computed from its arguments' example values."""
    node = graph.create_node("call_method" if isinstance(target, str) else "call_function", target, args, kwargs)
    args, kwargs = fx.node.map_arg((args, kwargs), lambda arg: arg.meta["example_value"])
    node.meta["example_value"] = getattr(args[0], target)(*args[1:], **kwargs) if isinstance(target, str) \
        else target(*args, **kwargs)
    return node


def placeholder(graph: fx.Graph, value: torch.Tensor) -> fx.Node:
    node = graph.placeholder(f"x{sum(node.op == 'placeholder' for node in graph.nodes)}")
    node.meta["example_value"] = value
    return node


def build(target, *args, **kwargs) -> tuple[fx.Node, list[fx.Node]]:
    """``target(*args, **kwargs)`` in a fresh graph, each tensor argument a placeholder: the node and the
    placeholders, in argument order."""
    graph = fx.Graph()
    args, kwargs = fx.node.map_aggregate(
        (args, kwargs), lambda value: placeholder(graph, value) if isinstance(value, torch.Tensor) else value)
    node = call(graph, target, *args, **kwargs)
    return node, [arg for arg in graph.nodes if arg.op == "placeholder"]


def decide(node: fx.Node, placements: dict, permuted: bool = False):
    """The rule's decision for ``node`` at P = 2, its inputs placed as given (Replicate where not given)."""
    rule = rule_for(node, permuted)
    assert rule is not None, f"no rule for {node.target}"
    placements = {**{arg: REPLICATE for arg in node.graph.nodes if arg is not node}, **placements}
    return rule(node, RuleView(placements.get, world_size=2))


def empty(*shape, dtype=torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


# attention.py


def test_sdpa_keeps_qkv_sharded_on_the_sequence_and_demands_the_mask_whole():
    q, mask = empty(B, 2, S, H), torch.ones(S, S, dtype=torch.bool).tril()
    node, (query, key, value, attn_mask) = build(F.scaled_dot_product_attention, q, q.clone(), q.clone(),
                                                 attn_mask=mask)
    decision = decide(node, {query: Shard(2), key: Shard(2), value: Shard(2)})
    assert decision.output == Shard(2)
    assert decision.inputs == {query: Shard(2), key: Shard(2), value: Shard(2), attn_mask: REPLICATE}


def test_sdpa_demands_sharded_qkv_even_from_replicated_inputs():
    node, (query, key, value) = build(F.scaled_dot_product_attention, empty(B, S, H), empty(B, S, H), empty(B, S, H))
    decision = decide(node, {})
    assert decision.output == Shard(1)
    assert decision.inputs == {query: Shard(1), key: Shard(1), value: Shard(1)}


def test_sdpa_without_a_head_dim_is_refused():
    node, (query, key, value) = build(F.scaled_dot_product_attention, empty(S, H), empty(S, H), empty(S, H))
    assert decide(node, {query: Shard(0), key: Shard(0), value: Shard(0)}) is None


def test_a_handwritten_attention_output_leaves_the_heads_for_the_sequence():
    node, (x,) = build(attention_output, empty(B, 2, S, H), 1, 2)
    decision = decide(node, {x: Shard(1)})
    assert decision.output == Shard(2) and decision.inputs == {x: Shard(1)}


def test_a_handwritten_attention_output_with_heads_merged_in_the_batch_leaves_each_batchs_heads():
    node, (x,) = build(attention_output, empty(B * 4, S, H), 0, 1, B)
    decision = decide(node, {x: MergedShard(0, B, 1)})
    assert decision.output == Shard(1) and decision.inputs == {x: MergedShard(0, B, 1)}


def test_flash_attention_shards_qkv_on_dim_1_and_demands_alibi_slopes_whole():
    graph = fx.Graph()
    q, k, v, slopes = (graph.placeholder(name) for name in ("q", "k", "v", "slopes"))
    node = graph.call_function(flash_attention, (q, k, v, 0.0, None, True, (-1, -1), 0.0), {"alibi_slopes": slopes})
    decision = decide(node, {})
    assert decision.output == Shard(1)
    assert decision.inputs == {q: Shard(1), k: Shard(1), v: Shard(1), slopes: REPLICATE}


def test_flash_attention_varlen_shards_packed_tokens_and_demands_the_offsets_whole():
    graph = fx.Graph()
    q, k, v, cu_q, cu_k = (graph.placeholder(name) for name in ("q", "k", "v", "cu_q", "cu_k"))
    node = graph.call_function(flash_attention_varlen, (q, k, v, cu_q, cu_k, S, S, 0.0, None, True, (-1, -1), 0.0))
    decision = decide(node, {})
    assert decision.output == Shard(0)
    assert decision.inputs == {q: Shard(0), k: Shard(0), v: Shard(0), cu_q: REPLICATE, cu_k: REPLICATE}


# linalg.py


@pytest.mark.parametrize("bias", [False, True])
def test_linear_keeps_tokens_sharded_and_demands_the_weight_whole(bias):
    node, (x, *params) = build(F.linear, empty(B, S, H), empty(6, H), *([empty(6)] if bias else []))
    decision = decide(node, {x: Shard(1)})
    assert decision.output == Shard(1)
    assert decision.inputs == {x: Shard(1), **{param: REPLICATE for param in params}}


@pytest.mark.parametrize("placement", [REPLICATE, Shard(2)], ids=["replicated", "sharded on features"])
def test_linear_is_refused_on_replicated_input_or_input_sharded_on_the_contracted_dim(placement):
    node, (x, _) = build(F.linear, empty(B, S, H), empty(6, H))
    assert decide(node, {x: placement}) is None


def test_matmul_against_a_weight_keeps_rows_sharded_and_merged_sequences_stay_merged():
    node, (a, b) = build(torch.matmul, empty(B * S, H), empty(H, 6))
    decision = decide(node, {a: MergedShard(0, B, 1)})
    assert decision.output == MergedShard(0, B, 1)
    assert decision.inputs == {a: MergedShard(0, B, 1), b: REPLICATE}


@pytest.mark.parametrize("kv_heads, demanded", [(2, Shard(1)), (1, REPLICATE)], ids=["sliced", "broadcast"])
def test_matmul_sharded_on_a_batch_dim_slices_a_replicated_operand_unless_it_broadcasts(kv_heads, demanded):
    node, (a, b) = build(operator.matmul, empty(B, 2, S, H), empty(B, kv_heads, H, S))
    decision = decide(node, {a: Shard(1)})
    assert decision.output == Shard(1)
    assert decision.inputs == {a: Shard(1), b: demanded}


def test_matmul_of_operands_sharded_alike_on_heads_stays_sharded():
    node, (a, b) = build(torch.matmul, empty(B, 2, S, H), empty(B, 2, H, S))
    decision = decide(node, {a: Shard(1), b: Shard(1)})
    assert decision.output == Shard(1) and decision.inputs == {a: Shard(1), b: Shard(1)}


def test_matmul_with_a_right_operand_sharded_on_its_columns_shards_the_output_columns():
    node, (a, b) = build(torch.matmul, empty(B, H, 6), empty(B, 6, S))
    decision = decide(node, {b: Shard(2)})
    assert decision.output == Shard(2) and decision.inputs == {a: REPLICATE, b: Shard(2)}


@pytest.mark.parametrize("a_placement, b_placement", [(Shard(2), REPLICATE), (REPLICATE, Shard(1))],
                         ids=["contracted", "right operand rows"])
def test_matmul_sharded_on_a_contracted_dim_is_refused(a_placement, b_placement):
    node, (a, b) = build(torch.matmul, empty(B, S, S), empty(B, S, S))
    assert decide(node, {a: a_placement, b: b_placement}) is None


def test_matmul_of_operands_sharded_apart_reads_the_smaller_whole():
    """A sparse attention's indexer: the rank's queries of every head against every key (one head):
    the keys arrive whole, the queries keep their rows, and so does the result."""
    node, (q, k_t) = build(torch.matmul, empty(B, S, H, 6), empty(B, 1, 6, S))
    decision = decide(node, {q: Shard(1), k_t: Shard(3)})
    assert decision.output == Shard(1) and decision.inputs == {q: Shard(1), k_t: REPLICATE}
    node, (k_t, q) = build(torch.matmul, empty(B, 1, S, 6), empty(B, H, 6, S))
    decision = decide(node, {k_t: Shard(2), q: Shard(3)})
    assert decision.output == Shard(3) and decision.inputs == {k_t: REPLICATE, q: Shard(3)}


def test_einsum_keeping_the_sequence_letter_shards_the_output_there():
    node, (x, w) = build(torch.einsum, "bsh,hd->bds", empty(B, S, H), empty(H, 6))
    decision = decide(node, {x: Shard(1)})
    assert decision.output == Shard(2) and decision.inputs == {x: Shard(1), w: REPLICATE}


def test_einsum_summing_over_the_sequence_letter_is_partial():
    node, (x, y) = build(torch.einsum, "bsh,bsd->bhd", empty(B, S, H), empty(B, S, 6))
    decision = decide(node, {x: Shard(1), y: Shard(1)})
    assert decision.output == PARTIAL and decision.inputs == {x: Shard(1), y: Shard(1)}


@pytest.mark.parametrize("equation, y_shape, y_placement", [("bsh,bsd->bhd", (B, S, 6), REPLICATE),
                                                            ("...h,hd->...d", (H, 6), REPLICATE)],
                         ids=["sequence letter replicated", "ellipsis"])
def test_einsum_is_refused_unless_one_letter_is_sharded_alike_everywhere(equation, y_shape, y_placement):
    node, (x, y) = build(torch.einsum, equation, empty(B, S, H), empty(*y_shape))
    assert decide(node, {x: Shard(1), y: y_placement}) is None


def test_einsum_of_two_sharded_letters_reads_the_smaller_operand_whole():
    node, (x, y) = build(torch.einsum, "bsh,bt->bst", empty(B, S, H), empty(B, S))
    decision = decide(node, {x: Shard(1), y: Shard(1)})
    assert decision.output == Shard(1) and decision.inputs == {x: Shard(1), y: REPLICATE}


def test_index_select_of_a_whole_table_follows_its_ids_and_is_refused_for_a_sharded_table():
    node, (table, ids) = build(torch.index_select, empty(32, H), 0, torch.zeros(B * S, dtype=torch.long))
    decision = decide(node, {ids: MergedShard(0, B, 1)})
    assert decision.output == MergedShard(0, B, 1) and decision.inputs == {ids: MergedShard(0, B, 1), table: REPLICATE}
    assert decide(node, {ids: Shard(0), table: Shard(0)}) is None


def test_embedding_is_sharded_like_its_ids_and_refused_with_max_norm():
    node, (ids, table) = build(F.embedding, torch.zeros(B, S, dtype=torch.long), empty(10, H))
    decision = decide(node, {ids: Shard(1)})
    assert decision.output == Shard(1) and decision.inputs == {ids: Shard(1), table: REPLICATE}
    node, (ids, _) = build(F.embedding, torch.zeros(B, S, dtype=torch.long), torch.ones(10, H), max_norm=1.0)
    assert decide(node, {ids: Shard(1)}) is None


def test_outer_of_sharded_positions_and_frequencies_shards_the_rows_and_of_both_is_refused():
    node, (positions, frequencies) = build(torch.outer, empty(S), empty(H))
    decision = decide(node, {positions: Shard(0)})
    assert decision.output == Shard(0) and decision.inputs == {positions: Shard(0), frequencies: REPLICATE}
    node, (frequencies, positions) = build("outer", empty(H), empty(S))
    decision = decide(node, {positions: Shard(0)})
    assert decision.output == Shard(1) and decision.inputs == {frequencies: REPLICATE, positions: Shard(0)}
    node, (a, b) = build(torch.outer, empty(S), empty(S))
    assert decide(node, {a: Shard(0), b: Shard(0)}) is None


@pytest.mark.parametrize("bias_shape, demanded", [((6,), REPLICATE), ((S, 6), Shard(0))], ids=["row", "per token"])
def test_addmm_keeps_rows_sharded_and_slices_a_per_token_bias(bias_shape, demanded):
    node, (bias, rows, w) = build(torch.addmm, empty(*bias_shape), empty(S, H), empty(H, 6))
    decision = decide(node, {rows: Shard(0)})
    assert decision.output == Shard(0) and decision.inputs == {rows: Shard(0), w: REPLICATE, bias: demanded}


# losses.py


def _tokens(*shape, classes: int = 5) -> torch.Tensor:
    return torch.randint(classes, shape)


def test_token_loss_mean_is_replicated_from_partial_sum_and_count():
    node, (logits, labels) = build(F.cross_entropy, empty(B * S, 5), _tokens(B * S))
    decision = decide(node, {logits: MergedShard(0, B, 1)})
    assert decision.output == REPLICATE and decision.localize is not None
    assert decision.inputs == {logits: MergedShard(0, B, 1), labels: MergedShard(0, B, 1)}


@pytest.mark.parametrize("reduction, output", [("sum", PARTIAL), ("none", Shard(1))])
def test_token_loss_sum_is_partial_and_per_token_loss_sharded_past_the_class_dim(reduction, output):
    weight = torch.rand(5)
    node, (logits, labels, weight) = build(F.nll_loss, empty(B, 5, S), _tokens(B, S), weight, reduction=reduction)
    decision = decide(node, {logits: Shard(2)})
    assert decision.output == output and decision.localize is None
    assert decision.inputs == {logits: Shard(2), labels: Shard(1), weight: REPLICATE}


def test_token_loss_on_class_probabilities_demands_them_sharded_like_the_logits():
    node, (logits, probabilities) = build(F.cross_entropy, empty(S, 5), torch.rand(S, 5).softmax(-1))
    decision = decide(node, {logits: Shard(0)})
    assert decision.output == REPLICATE
    assert decision.inputs == {logits: Shard(0), probabilities: Shard(0)}


@pytest.mark.parametrize("placement, options", [
    (REPLICATE, {}), (Shard(1), {}), (Shard(0), {"size_average": True}),
    (Shard(0), {"label_smoothing": 0.1, "weight": torch.rand(5)}),
], ids=["replicated logits", "sharded on classes", "legacy size_average", "smoothing with weights"])
@pytest.mark.filterwarnings("ignore:size_average and reduce args will be deprecated")
def test_token_loss_is_refused(placement, options):
    node, (logits, *_) = build(F.cross_entropy, empty(S, 5), _tokens(S), **options)
    assert decide(node, {logits: placement}) is None


# pointwise.py


@pytest.mark.parametrize("other_shape, demanded", [
    ((H,), REPLICATE), ((B, 1, H), REPLICATE), ((S, H), Shard(0)), ((B, S, H), Shard(1)),
], ids=["norm weight", "broadcast over the sequence", "position table", "same shape"])
def test_binary_op_keeps_the_sequence_sharded_and_slices_only_operands_that_span_it(other_shape, demanded):
    node, (x, other) = build(operator.mul, empty(B, S, H), empty(*other_shape))
    decision = decide(node, {x: Shard(1)})
    assert decision.output == Shard(1) and decision.inputs == {x: Shard(1), other: demanded}


def test_unary_method_keeps_a_merged_sequence_merged():
    node, (x,) = build("sigmoid", empty(B * S, H))
    decision = decide(node, {x: MergedShard(0, B, 1)})
    assert decision.output == MergedShard(0, B, 1) and decision.inputs == {x: MergedShard(0, B, 1)}


@pytest.mark.parametrize("x_placement, y_placement", [(REPLICATE, REPLICATE), (Shard(1), Shard(2)),
                                                      (Shard(1), MergedShard(1, 2, 1))],
                         ids=["nothing sharded", "sharded apart", "one sharded in two blocks"])
def test_binary_op_is_refused_without_one_sharding_for_all_inputs(x_placement, y_placement):
    node, (x, y) = build(torch.add, empty(B, S, S), empty(B, S, S))
    assert decide(node, {x: x_placement, y: y_placement}) is None


def test_in_place_op_on_a_replicated_tensor_with_a_sharded_operand_is_refused():
    node, (x, y) = build("add_", empty(B, S, H), empty(B, S, H))
    assert decide(node, {x: REPLICATE, y: Shard(1)}) is None
    assert decide(node, {x: Shard(1), y: REPLICATE}).inputs == {x: Shard(1), y: Shard(1)}


def test_dropout_keeps_its_block_and_draws_it_from_the_global_mask():
    node, (x,) = build(F.dropout, empty(B, S, H), 0.1)
    decision = decide(node, {x: Shard(1)})
    assert decision.output == Shard(1) and decision.inputs == {x: Shard(1)} and decision.localize is not None
    node, (x,) = build(F.dropout, torch.ones(B, S, H), 0.1, inplace=True)
    assert decide(node, {x: Shard(1)}) is None


def test_type_as_leaves_the_tensor_it_reads_the_dtype_of_where_it_is():
    node, (x, like) = build("type_as", empty(B, S, H), empty(B, S, H, dtype=torch.bfloat16))
    decision = decide(node, {x: Shard(1), like: PARTIAL})
    assert decision.output == Shard(1) and decision.inputs == {x: Shard(1), like: PARTIAL}


# reductions.py


def test_count_nonzero_over_the_sequence_is_the_ranks_partial_count():
    node, (x,) = build(torch.count_nonzero, empty(B, S, H), dim=1)
    decision = decide(node, {x: Shard(1)})
    assert decision.output == PARTIAL and decision.inputs == {x: Shard(1)}
    node, (x,) = build(torch.count_nonzero, empty(B, S, H), dim=2)
    assert decide(node, {x: Shard(1)}).output == Shard(1)


def test_normalize_along_the_features_keeps_the_block_and_along_the_sequence_refuses():
    for args, kwargs in (((), {"dim": -1}), ((2.0, -1), {})):  # p and dim by keyword or position
        node, (x,) = build(F.normalize, empty(B, S, H), *args, **kwargs)
        decision = decide(node, {x: Shard(1)})
        assert decision.output == Shard(1) and decision.inputs == {x: Shard(1)}
    node, (x,) = build(F.normalize, empty(B, S, H))  # dim=1 by default: the sequence here
    assert decide(node, {x: Shard(1)}) is None
    node, (x,) = build(F.normalize, empty(B, H, S))  # dim=1 by default: the features here
    assert decide(node, {x: Shard(2)}).output == Shard(2)


@pytest.mark.parametrize("target, kwargs, output", [
    ("sum", {"dim": -1}, Shard(1)), ("mean", {"dim": 0}, Shard(0)), ("mean", {"dim": 0, "keepdim": True}, Shard(1)),
    ("amax", {"dim": (0, 2)}, Shard(0)), (torch.std, {"dim": 2}, Shard(1)), ("norm", {"dim": -1}, Shard(1)),
])
def test_reduction_over_other_dims_keeps_the_sequence_sharded_where_it_lands(target, kwargs, output):
    node, (x,) = build(target, empty(B, S, H), **kwargs)
    decision = decide(node, {x: Shard(1)})
    assert decision.output == output and decision.inputs == {x: Shard(1)}


def test_max_over_another_dim_shards_its_values_and_indices():
    node, (x,) = build(torch.max, empty(B, S, H), dim=-1)
    assert decide(node, {x: Shard(1)}).output == (Shard(1), Shard(1))


@pytest.mark.parametrize("target, kwargs, rewritten", [
    ("sum", {"dim": 1}, False), (torch.sum, {}, False), ("mean", {"dim": (1, 2)}, True),
    (torch.nansum, {"dim": 1, "keepdim": True}, False),
])
def test_sum_or_mean_over_the_sequence_is_partial_and_a_mean_is_rewritten_to_its_global_count(
        target, kwargs, rewritten):
    node, (x,) = build(target, empty(B, S, H), **kwargs)
    decision = decide(node, {x: Shard(1)})
    assert decision.output == PARTIAL and decision.inputs == {x: Shard(1)}
    assert (decision.localize is not None) == rewritten


def test_cumsum_along_the_sequence_is_a_partial_scan():
    node, (x,) = build(torch.cumsum, empty(B, S, H), 1)
    decision = decide(node, {x: Shard(1)})
    assert decision.output == PartialScan(1) and decision.inputs == {x: Shard(1)}


@pytest.mark.parametrize("target, dim, placement", [
    ("amax", 1, Shard(1)), ("max", 1, Shard(1)), (torch.var, 1, Shard(1)), ("logsumexp", 1, Shard(1)),
    (torch.softmax, 1, Shard(1)), ("cumprod", 1, Shard(1)), ("cumsum", 1, MergedShard(1, 1, 2)),
    ("sum", 1, REPLICATE),
], ids=["amax", "max", "var", "logsumexp", "softmax", "cumprod", "merged cumsum", "replicated"])
def test_other_reductions_along_the_sequence_are_refused(target, dim, placement):
    node, (x,) = build(target, empty(B, S, H), dim)
    assert decide(node, {x: placement}) is None


def test_elementwise_max_of_two_tensors_is_pointwise():
    node, (a, b) = build(torch.max, empty(B, S, H), empty(H))
    decision = decide(node, {a: Shard(1)})
    assert decision.output == Shard(1) and decision.inputs == {a: Shard(1), b: REPLICATE}


@pytest.mark.parametrize("target", [torch.multiply, torch.subtract, torch.greater, torch.special.expit],
                         ids=["multiply", "subtract", "greater", "expit"])
def test_aliases_of_elementwise_ops_are_elementwise(target):
    """ATen's aliases carry no pointwise tag (Gemma 3n's ``torch.multiply``)."""
    args = (empty(B, S, H),) if target is torch.special.expit else (empty(B, S, H), empty(H))
    node, inputs = build(target, *args)
    decision = decide(node, {inputs[0]: Shard(1)})
    assert decision.output == Shard(1) and decision.inputs[inputs[0]] == Shard(1)


@pytest.mark.parametrize("method, args", [("new_ones", ((B, S, 5),)), ("new_zeros", ((B, S, 5),)),
                                          ("new_full", ((B, S, 5), 2.0)), ("new_empty", ((B, 3),))])
def test_a_new_tensor_not_made_in_blocks_is_made_whole_without_gathering_its_source(method, args):
    """``x.new_ones(sizes)`` reads only x's dtype and device: made whole from the global sizes, x left as
    it is (DeepSeek-V3.2's top-k mask)."""
    node, (x,) = build(method, empty(B, S, H, dtype=torch.int64), *args)
    decision = decide(node, {x: Shard(1)})
    assert decision.output == REPLICATE and decision.inputs == {x: Shard(1)}


@pytest.mark.parametrize("dim, placement", [(2, Shard(1)), (-1, Shard(1)), (1, None)],
                         ids=["another dim", "negative dim", "the sharded dim"])
def test_a_strided_aten_slice_keeps_the_sharding_of_another_dim(dim, placement):
    """torch's generic associative_scan takes odd and even positions with ``aten.slice``; along a dim
    other than the sharded one the sharding stays."""
    node, (x,) = build(torch.ops.aten.slice, empty(B, S, H), dim, 0, -1, 2)
    decision = decide(node, {x: Shard(1)})
    assert (decision.output if decision else None) == placement


def test_softmax_along_the_features_stays_sharded():
    node, (x,) = build(F.softmax, empty(B, S, H), dim=-1)
    decision = decide(node, {x: Shard(1)})
    assert decision.output == Shard(1) and decision.inputs == {x: Shard(1)}


@pytest.mark.parametrize("target, params", [(F.layer_norm, 2), (F.rms_norm, 1)])
def test_norm_over_the_features_keeps_tokens_sharded_and_demands_its_parameters_whole(target, params):
    node, (x, *weights) = build(target, empty(B, S, H), (H,), *(empty(H) for _ in range(params)))
    decision = decide(node, {x: Shard(1)})
    assert decision.output == Shard(1) and decision.inputs == {x: Shard(1), **{w: REPLICATE for w in weights}}


def test_norm_over_the_sequence_is_refused():
    node, (x, _) = build(F.layer_norm, empty(B, S, H), (S, H), empty(S, H))
    assert decide(node, {x: Shard(1)}) is None


# routing.py

T, E, K = 6, 4, 2


@pytest.mark.parametrize("target", [torch.topk, "sort", torch.argsort])
def test_selection_along_the_experts_is_each_tokens_own(target):
    node, (scores,) = build(target, torch.rand(T, E), *((K,) if target is torch.topk else ()))
    decision = decide(node, {scores: Shard(0)})
    outputs = (Shard(0), Shard(0)) if target != torch.argsort else Shard(0)
    assert decision.output == outputs and decision.inputs == {scores: Shard(0)}


@pytest.mark.parametrize("target", ["sort", torch.argsort])
def test_sorting_sharded_rows_permutes_each_ranks_own_block(target):
    node, (ids,) = build(target, torch.randint(E, (T * K,)))
    decision = decide(node, {ids: MergedShard(0, 1, K)})
    rows = PermutedShard(0, 1, K, node.name)
    positions = Positions(rows, MergedShard(0, 1, K))
    assert decision.output == ((rows, positions) if target == "sort" else positions)
    assert decision.inputs == {ids: MergedShard(0, 1, K)}


@pytest.mark.parametrize("target, args", [(torch.topk, (K, 0)), ("sort", (0,))], ids=["topk", "sort"])
def test_selection_along_the_sequence_of_a_2d_tensor_is_refused(target, args):
    node, (scores,) = build(target, torch.rand(T, E), *args)
    assert decide(node, {scores: Shard(0)}) is None


def test_histc_over_a_fixed_range_counts_partially_and_its_default_range_is_refused():
    node, (ids,) = build(torch.histc, torch.rand(T * K) * E, E, 0, E - 1)
    decision = decide(node, {ids: Shard(0)})
    assert decision.output == PARTIAL and decision.inputs == {ids: Shard(0)}
    node, (ids,) = build("histc", torch.rand(T * K) * E, E)
    assert decide(node, {ids: Shard(0)}) is None


def test_one_hot_of_sharded_ids_stays_sharded_and_of_replicated_ids_is_refused():
    node, (ids,) = build(F.one_hot, torch.randint(E, (B, S)), E)
    assert decide(node, {ids: Shard(1)}).output == Shard(1)
    assert decide(node, {ids: REPLICATE}) is None


@pytest.mark.parametrize("dim, output", [(1, Shard(0)), (0, None)], ids=["along the experts", "along the tokens"])
def test_scatter_writes_each_tokens_own_row_and_is_refused_along_the_tokens(dim, output):
    node, (mask, index, src) = build("scatter", torch.zeros(T, E), dim, torch.zeros(T, K, dtype=torch.long),
                                     torch.ones(T, K))
    decision = decide(node, {mask: Shard(0), index: Shard(0), src: Shard(0)})
    if output is None:
        assert decision is None
    else:
        assert decision.output == output and decision.inputs == {mask: Shard(0), index: Shard(0), src: Shard(0)}


def test_a_new_tensor_like_a_sharded_one_is_made_block_by_block():
    node, (x,) = build(torch.zeros_like, empty(B, S, H))
    decision = decide(node, {x: Shard(1)})
    assert decision.output == Shard(1) and decision.inputs == {x: Shard(1)}
    assert decide(node, {x: REPLICATE}) is None


ROWS = PermutedShard(0, 1, K, "sort")


@pytest.mark.parametrize("other_shape, placement, output", [
    ((H,), REPLICATE, ROWS), ((1, H), REPLICATE, ROWS), ((T * K, 1), REPLICATE, None),
    ((T * K, H), MergedShard(0, 1, K), None), ((T * K, H), ROWS, ROWS),
    ((T * K, H), PermutedShard(0, 1, K, "other sort"), None),
], ids=["broadcast", "broadcast row", "a value per row in token order", "rows in token order", "same order",
        "another order"])
def test_permuted_rows_meet_only_rows_in_their_own_order_or_broadcast_operands(other_shape, placement, output):
    node, (x, other) = build(operator.mul, empty(T * K, H), empty(*other_shape))
    decision = decide(node, {x: ROWS, other: placement}, permuted=True)
    if output is None:
        assert decision is None
    else:
        assert decision.output == output and decision.inputs == {x: ROWS, other: placement}


def test_a_sum_over_permuted_rows_is_partial_and_over_features_keeps_them():
    node, (x,) = build("sum", empty(T * K, H), 0)
    assert decide(node, {x: ROWS}, permuted=True).output == PARTIAL
    node, (x,) = build("sum", empty(T * K, H), -1)
    assert decide(node, {x: ROWS}, permuted=True).output == ROWS


def test_the_docstrings_dispatch_sorts_each_ranks_rows_and_puts_them_back_in_token_order():
    graph = fx.Graph()
    probs, h = placeholder(graph, torch.rand(T, E)), placeholder(graph, torch.rand(T, H))
    ids = call(graph, "reshape", call(graph, operator.getitem, call(graph, torch.topk, probs, K), 1), -1)
    order = call(graph, torch.sort, ids)
    ids_sorted, perm = call(graph, operator.getitem, order, 0), call(graph, operator.getitem, order, 1)
    rows = call(graph, operator.getitem, h, call(graph, operator.floordiv, perm, K))
    counts = call(graph, torch.histc, call(graph, "float", ids_sorted), E, 0, E - 1)
    inv = call(graph, torch.empty_like, perm)
    put = call(graph, operator.setitem, inv, perm, call(graph, torch.arange, T * K))
    back = call(graph, operator.getitem, call(graph, "mul", rows, 2.0), inv)
    placements = {probs: Shard(0), h: Shard(0)}
    for node in graph.nodes:
        if node.all_input_nodes:
            permuted = any(is_permuted(placements.get(arg, REPLICATE)) for arg in node.all_input_nodes)
            placements[node] = decide(node, placements, permuted=permuted).output
    sorted_rows, tokens = PermutedShard(0, 1, K, order.name), MergedShard(0, 1, K)
    assert placements[ids] == tokens
    assert placements[perm] == Positions(sorted_rows, tokens)
    assert placements[rows] == sorted_rows
    assert placements[counts] == Partial(over=order.name)
    assert placements[inv] == placements[put] == Positions(tokens, sorted_rows)
    assert placements[back] == tokens


# shape_ops.py


@pytest.mark.parametrize("target, args, output", [
    ("view", ((B * S, H),), MergedShard(0, B, 1)), ("reshape", (B, S, 2, 2), Shard(1)),
    (torch.flatten, (1,), MergedShard(1, 1, H)), ("unflatten", (-1, (2, 2)), Shard(1)),
])
def test_view_keeps_the_sequence_inside_one_dim_and_rewrites_its_shape(target, args, output):
    node, (x,) = build(target, empty(B, S, H), *args)
    decision = decide(node, {x: Shard(1)})
    assert decision.output == output and decision.inputs == {x: Shard(1)} and decision.localize is not None


def test_view_back_from_merged_tokens_restores_the_sequence_dim():
    node, (x,) = build("view", empty(B * S, H), B, S, H)
    assert decide(node, {x: MergedShard(0, B, 1)}).output == Shard(1)


@pytest.mark.parametrize("shape", [(B, 2, S // 2, H), (B * S // 2, 2 * H)], ids=["sequence split", "token pairs"])
def test_view_cutting_the_sequence_across_dims_is_refused(shape):
    node, (x,) = build("view", empty(B, S, H), *shape)
    assert decide(node, {x: Shard(1)}) is None


@pytest.mark.parametrize("target, args, output", [
    ("transpose", (1, 2), Shard(2)), (torch.permute, ((2, 0, 1),), Shard(2)), ("unsqueeze", (0,), Shard(2)),
    ("squeeze", (), Shard(0)), ("movedim", (1, 0), Shard(0)),
])
def test_dim_shuffles_move_the_sharded_dim_with_the_data(target, args, output):
    node, (x,) = build(target, empty(1, S, H), *args)
    decision = decide(node, {x: Shard(1)})
    assert decision.output == output and decision.inputs == {x: Shard(1)}


@pytest.mark.parametrize("index, output", [
    ((slice(None), slice(None), slice(0, 2)), Shard(1)), ((0, Ellipsis, None), Shard(0)),
    ((slice(None), -1), PARTIAL),
    ((slice(None), slice(None, 1)), PARTIAL),
], ids=["features sliced", "batch picked", "one position of the sequence", "rows inside one block"])
def test_indexing_leaving_the_sequence_whole_stays_sharded_and_one_position_of_it_is_partial(index, output):
    node, (x,) = build(operator.getitem, empty(B, S, H), index)
    decision = decide(node, {x: Shard(1)})
    assert decision.output == output and decision.inputs == {x: Shard(1)}
    assert (decision.localize is not None) == (output == PARTIAL)


@pytest.mark.parametrize("index", [(slice(None), slice(None, None, 2)),
                                   (slice(None), [0, 2]), (slice(None), torch.tensor([0, 1])),
                                   torch.tensor([1, 0])],
                         ids=["strided", "listed", "tensor index",
                              "tensor index on the batch"])
def test_indexing_into_the_sequence_or_with_a_tensor_is_refused(index):
    node, (x, *_) = build(operator.getitem, empty(B, S, H), index)
    assert decide(node, {x: Shard(1)}) is None


def test_a_replicated_table_read_at_sharded_ids_is_sharded_like_the_ids():
    node, (table, ids) = build(operator.getitem, empty(E, H), torch.randint(E, (B, S)))
    decision = decide(node, {ids: Shard(1)})
    assert decision.output == Shard(1) and decision.inputs == {table: REPLICATE, ids: Shard(1)}


def test_a_part_of_a_tuple_takes_its_own_placement():
    graph = fx.Graph()
    parts = call(graph, "chunk", placeholder(graph, empty(B, S, H)), 2, -1)
    node = call(graph, operator.getitem, parts, 1)
    decision = decide(node, {parts: (Shard(1), MergedShard(1, 1, 2))})
    assert decision.output == MergedShard(1, 1, 2) and decision.inputs == {}


@pytest.mark.parametrize("target, args, output", [
    ("chunk", (2, -1), (Shard(1), Shard(1))), (torch.split, (1, 0), (Shard(1), Shard(1))),
    ("unbind", (0,), (Shard(0), Shard(0))), ("split", (S // 2, 1), None),
], ids=["chunk features", "split batch", "unbind batch", "split sequence"])
def test_splits_keep_the_sequence_sharded_unless_they_cut_it(target, args, output):
    node, (x,) = build(target, empty(B, S, H), *args)
    decision = decide(node, {x: Shard(1)})
    assert (decision.output if decision else None) == output


@pytest.mark.parametrize("target, dim, output", [
    (torch.cat, -1, Shard(1)), (torch.stack, 0, Shard(2)), (torch.stack, 2, Shard(1)), (torch.cat, 1, None),
], ids=["cat features", "stack before", "stack after", "cat sequence"])
def test_cat_and_stack_of_parts_sharded_alike_stay_sharded_and_a_cat_along_the_sequence_is_refused(
        target, dim, output):
    node, (a, b) = build(target, [empty(B, S, H), empty(B, S, H)], dim)
    decision = decide(node, {a: Shard(1), b: Shard(1)})
    if output is None:
        assert decision is None
    else:
        assert decision.output == output and decision.inputs == {a: Shard(1), b: Shard(1)}


def test_cat_slices_a_replicated_part_to_the_sharding_of_the_others():
    node, (a, b) = build(torch.cat, [empty(B, S, H), empty(B, S, 2)], -1)
    decision = decide(node, {a: Shard(1)})
    assert decision.output == Shard(1) and decision.inputs == {a: Shard(1), b: Shard(1)}


def test_size_of_a_sharded_tensor_is_its_global_size():
    node, (x,) = build("size", empty(B, S, H), 1)
    decision = decide(node, {x: Shard(1)})
    assert decision.output is None and decision.inputs == {x: Shard(1)} and decision.localize is not None
    assert decide(node, {x: REPLICATE}) is None


@pytest.mark.parametrize("target, shape, args, output", [
    ("repeat", (S, H), (2, 1), MergedShard(0, 2, 1)), ("repeat_interleave", (S, H), (K, 0), MergedShard(0, 1, K)),
    ("repeat_interleave", (S, H), (K, -1), Shard(0)), ("expand", (1, S, H), (2, S, H), Shard(1)),
])
def test_repeats_and_expands_place_the_rank_block_in_each_copy(target, shape, args, output):
    node, (x,) = build(target, empty(*shape), *args)
    placement = Shard(len(shape) - 2)
    decision = decide(node, {x: placement})
    assert decision.output == output and decision.inputs == {x: placement}


def test_expand_as_reads_only_the_other_tensors_shape():
    """``F.normalize``'s ``norm.clamp_min(eps).expand_as(x)``: the norm sharded with ``x`` expands to the
    block; a replicated ``[1, 1, H]`` broadcast along the sequence ``x`` holds sharded expands to the
    block too; a replicated operand whose sequence is whole cannot become a block this way."""
    node, (norm, x) = build("expand_as", empty(B, S, 1), empty(B, S, H))
    decision = decide(node, {norm: Shard(1), x: Shard(1)})
    assert decision.output == Shard(1) and decision.inputs == {norm: Shard(1), x: Shard(1)}
    assert decision.localize is not None
    node, (scale, x) = build("expand_as", empty(1, 1, H), empty(B, S, H))
    decision = decide(node, {x: Shard(1)})
    assert decision.output == Shard(1) and decision.inputs == {scale: REPLICATE, x: Shard(1)}
    node, (whole, x) = build("expand_as", empty(1, S, H), empty(B, S, H))
    assert decide(node, {x: Shard(1)}) is None


def test_setitem_with_the_sequence_left_whole_writes_each_ranks_block():
    node, (x, value) = build(operator.setitem, torch.zeros(B, S, H), (Ellipsis, slice(0, 2)), torch.ones(B, S, 2))
    decision = decide(node, {x: Shard(1)})
    assert decision.output == Shard(1) and decision.inputs == {x: Shard(1), value: Shard(1)}
    node, (x, value) = build(operator.setitem, torch.zeros(B, S, H), (slice(None), 0), torch.ones(H))
    assert decide(node, {x: Shard(1)}) is None


def test_setitem_with_a_boolean_mask_is_a_masked_fill_of_each_ranks_block():
    """``ids[ids == image_token] = 0`` (Gemma 3): a mask computed whole is sliced to the block it writes."""
    node, (x, mask) = build(operator.setitem, torch.zeros(B, S, dtype=torch.long), torch.zeros(B, S, dtype=torch.bool), 0)
    for mask_placement in (Shard(1), REPLICATE):
        decision = decide(node, {x: Shard(1), mask: mask_placement})
        assert decision.output == Shard(1) and decision.inputs == {x: Shard(1), mask: Shard(1)}
    assert decide(node, {x: Shard(1), mask: Shard(0)}) is None
    node, (x, mask) = build(operator.setitem, torch.zeros(B, S, H), torch.zeros(B, dtype=torch.bool), 0)
    assert decide(node, {x: Shard(1)}) is None  # a mask over the batch alone: not this rule's


@pytest.mark.parametrize("name", ["normalize_expand_as", "scale_expand_as", "count_nonzero_over_tokens"])
def test_a_model_around_these_rules_gathers_nothing(fake_group, name):
    """The op probes of the rules added last, as a model holds them: nothing gathered (their exactness
    against eager: the op probes at P = 2, slow tier)."""
    from graphs import rewritten_graphs
    from op_probes import PROBES

    fake_group(2)
    (gm,) = rewritten_graphs(PROBES[name](), (torch.randint(0, 32, (2, 15)),))
    report = gm.meta["ulysses_report"]
    assert report.fallbacks == [] and not report.replicated, str(report)
    assert not [c for c in report.collectives if c.kind.startswith("gather")], report.collectives
