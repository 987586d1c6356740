"""One-process structure tests on a fake process group: what the rewritten graph contains."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from expecttest import assert_expected_inline

from graphs import calls, rewritten_graphs, sent_to_heads
from models import MeanPooledClassifier, model_zoo, token_batch, tiny_gpt2, tiny_llama, zoo_inputs
from ulysses_compile import DivisibilityError, UnsupportedError
from ulysses_compile.core.boundary import SequenceBlocks
from ulysses_compile.core.collectives import (
    gather_kv_heads,
    gather_seq,
    heads_to_seq,
    reduce_partial,
    scatter_seq,
    seq_to_heads,
    seq_to_heads_qkv,
    sync_grad,
)
from ulysses_compile.core.sharding import is_rank_local, sharding_of


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_llama_has_two_all_to_alls_per_layer_and_local_shapes(fake_group, world_size):
    fake_group(world_size)
    heads, kv_heads, layers, seq = 8, (4 if world_size < 8 else 8), 3, 64
    model = tiny_llama(heads=heads, kv_heads=kv_heads, layers=layers)
    ids, labels = token_batch(seq=seq)
    (gm,) = rewritten_graphs(model, (), {"input_ids": ids, "labels": labels, "use_cache": False})
    # the KV heads split like the query heads: q, k and v go to heads by one all-to-all
    to_heads, to_seq = calls(gm, seq_to_heads_qkv), calls(gm, heads_to_seq)
    assert len(to_heads) == layers and len(to_seq) == layers
    assert calls(gm, seq_to_heads) == [] and calls(gm, gather_kv_heads) == []
    local = seq // world_size
    head_dim = model.config.head_dim
    sent = sent_to_heads(gm)
    shapes = [tuple(inp.shape) for inp, _ in sent]
    assert shapes == [(2, heads, local, head_dim), (2, kv_heads, local, head_dim), (2, kv_heads, local, head_dim)] * layers
    for inp, out in sent:
        assert tuple(out.shape) == (2, inp.shape[1] // world_size, seq, head_dim)
    for node in to_seq:
        assert tuple(node.meta["val"].shape) == (2, heads, local, head_dim)
    # nothing gathered: the logits leave as the rank's block, the loss needs two scalar all-reduces
    assert calls(gm, gather_seq) == []
    assert list(gm.meta["ulysses_report"].sharded_outputs.values()) == [SequenceBlocks(1, 1, 1, seq)]
    assert [n.args[0].meta["val"].dim() for n in calls(gm, reduce_partial)] == [0, 0]
    synced = {n.args[0].name for n in calls(gm, sync_grad)}
    params = [n.name for n in gm.graph.nodes if n.op == "placeholder" and "_parameters_" in n.name]
    assert synced == set(params)
    assert gm.meta["ulysses_report"].fallbacks == []


def test_gpt2_merged_sequence_views_stay_sharded(fake_group):
    fake_group(4)
    ids, labels = token_batch(seq=32)
    graphs = rewritten_graphs(tiny_gpt2(), (), {"input_ids": ids, "labels": labels, "use_cache": False})
    model_graph = graphs[0]
    assert len(calls(model_graph, seq_to_heads_qkv)) == 2 and calls(model_graph, seq_to_heads) == []
    assert len(calls(model_graph, heads_to_seq)) == 2 and model_graph.meta["ulysses_report"].fallbacks == []
    # GPT-2's Conv1D flattens [B, S, H] to [B*S, H]: locally [B*S/P, H]
    addmm_rows = [n.args[1].meta["val"].shape[0] for n in model_graph.graph.nodes if n.target is torch.addmm]
    assert addmm_rows and set(addmm_rows) == {2 * 32 // 4}


class TinyAttention(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, d))


def normalized_code(gm) -> str:
    code = re.sub(r";  [\w =]+ = None", "", gm.code)
    lines = [line.rstrip() for line in code.strip().splitlines() if line.strip()]
    return "\n".join(lines)


def test_tiny_graph_before_and_after(fake_group):
    fake_group(2)
    torch.manual_seed(0)
    before = []

    def capture_before(gm, example_inputs):
        before.append(normalized_code(gm))
        return gm.forward

    model = TinyAttention()
    x = torch.randn(2, 8, 16)
    torch.compile(model, backend=capture_before)(x)
    torch.compiler.reset()
    (after,) = rewritten_graphs(model, (x,))
    assert_expected_inline(before[0], """\
def forward(self, L_x_ : torch.Tensor, L_self_modules_qkv_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_out_parameters_weight_ : torch.nn.parameter.Parameter):
    l_x_ = L_x_
    l_self_modules_qkv_parameters_weight_ = L_self_modules_qkv_parameters_weight_
    l_self_modules_out_parameters_weight_ = L_self_modules_out_parameters_weight_
    linear = torch._C._nn.linear(l_x_, l_self_modules_qkv_parameters_weight_, None)
    view = linear.view(2, 8, 3, 2, 8)
    permute = view.permute(2, 0, 3, 1, 4)
    q = permute[0]
    k = permute[1]
    v = permute[2]
    y = torch._C._nn.scaled_dot_product_attention(q, k, v, is_causal = True)
    transpose = y.transpose(1, 2)
    reshape = transpose.reshape(2, 8, 16)
    linear_1 = torch._C._nn.linear(reshape, l_self_modules_out_parameters_weight_, None)
    return (linear_1,)""")
    assert_expected_inline(normalized_code(after), """\
def forward(self, L_x_ : torch.Tensor, L_self_modules_qkv_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_out_parameters_weight_ : torch.nn.parameter.Parameter):
    l_x_ = L_x_
    l_self_modules_qkv_parameters_weight_ = L_self_modules_qkv_parameters_weight_
    l_self_modules_out_parameters_weight_ = L_self_modules_out_parameters_weight_
    rank = ulysses_compile_core_collectives_rank_of_group('0', device(type='cpu'))
    sync_grad_1 = ulysses_compile_core_collectives_sync_grad(l_self_modules_out_parameters_weight_, group_name = '0')
    sync_grad = ulysses_compile_core_collectives_sync_grad(l_self_modules_qkv_parameters_weight_, group_name = '0')
    scatter_seq = ulysses_compile_core_collectives_scatter_seq(l_x_, dim = 1, outer = 1, inner = 1, rank = rank, world_size = 2, group_name = '0')
    linear = torch._C._nn.linear(scatter_seq, sync_grad, None)
    view = linear.view((2, 4, 3, 2, 8))
    permute = view.permute(2, 0, 3, 1, 4)
    q = permute[0]
    k = permute[1]
    v = permute[2]
    seq_to_heads_qkv = ulysses_compile_core_collectives_seq_to_heads_qkv(q, key = k, value = v, seq_dim = 2, head_dim = 1, seq_len = 8, kv_seq_len = 8, rank = rank, world_size = 2, group_name = '0')
    getitem_3 = seq_to_heads_qkv[0]
    getitem_4 = seq_to_heads_qkv[1]
    getitem_5 = seq_to_heads_qkv[2]
    y = torch._C._nn.scaled_dot_product_attention(getitem_3, getitem_4, getitem_5, is_causal = True)
    heads_to_seq = ulysses_compile_core_collectives_heads_to_seq(y, seq_dim = 2, head_dim = 1, heads = 2, rank = rank, world_size = 2, group_name = '0')
    transpose = heads_to_seq.transpose(1, 2)
    reshape = transpose.reshape((2, 4, 16))
    linear_1 = torch._C._nn.linear(reshape, sync_grad_1, None)
    return (linear_1,)""")


@pytest.mark.parametrize("rank", [0, 3])
def test_uneven_heads_split_two_two_one_one(fake_group, rank):
    fake_group(4, rank)
    ids, labels = token_batch(seq=32)
    model = tiny_llama(heads=6, kv_heads=6, layers=1)
    (gm,) = rewritten_graphs(model, (), {"input_ids": ids, "labels": labels, "use_cache": False})
    heads = 2 if rank < 2 else 1  # 6 heads on 4 ranks: 2, 2, 1, 1
    head_dim = model.config.head_dim
    sent = sent_to_heads(gm)
    assert len(sent) == 3
    for inp, out in sent:
        assert tuple(inp.shape) == (2, 6, 8, head_dim)
        assert tuple(out.shape) == (2, heads, 32, head_dim)
    (back,) = calls(gm, heads_to_seq)
    assert tuple(back.args[0].meta["val"].shape) == (2, heads, 32, head_dim)
    assert tuple(back.meta["val"].shape) == (2, 6, 8, head_dim)
    assert len(calls(gm, seq_to_heads_qkv)) == 1 and calls(gm, seq_to_heads) == []
    assert gm.meta["ulysses_report"].fallbacks == []


def test_more_ranks_than_heads_where_no_ring_can_run_is_an_error_that_names_the_site(fake_group):
    """2 heads over 4 ranks need a ring, which needs the sequence in blocks of one size: 30 positions are
    not; with ring=1 the ring is ruled out."""
    fake_group(4)
    ids, labels = token_batch(seq=30)
    model = tiny_llama(heads=2, kv_heads=2, layers=1)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as raised:
        rewritten_graphs(model, (), {"input_ids": ids, "labels": labels, "use_cache": False})
    error = raised.value.inner_exception
    assert isinstance(error, DivisibilityError)
    message = str(error)
    assert "model.layers.0.self_attn" in message and "2 query heads over 4 sequence-parallel ranks need a ring" in message
    assert "sequence of 30 positions does not split in 4 blocks" in message
    assert "at most 2 ranks" in message and '"dp" dim' in message
    torch.compiler.reset()
    ids, labels = token_batch(seq=32)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="2 query heads cannot be split over 4 .* "
                       "option ring=1 rules out a ring"):
        rewritten_graphs(model, (), {"input_ids": ids, "labels": labels, "use_cache": False}, ring=1)


@pytest.mark.parametrize("seq,rank,local", [(30, 0, 8), (30, 3, 7), (6, 1, 2), (6, 3, 1)])
def test_sequences_that_do_not_divide_split_in_balanced_blocks(fake_group, seq, rank, local):
    fake_group(4, rank)
    ids, labels = token_batch(batch=seq, seq=seq)  # batch and sequence of the same size: found by position
    (gm,) = rewritten_graphs(tiny_llama(layers=1), (), {"input_ids": ids, "labels": labels, "use_cache": False})
    (scatter,) = [n for n in gm.graph.nodes if n.target is scatter_seq and n.args[0].name == "l_kwargs_input_ids_"]
    assert scatter.kwargs["dim"] == 1 and tuple(scatter.meta["val"].shape) == (seq, local)
    assert len(calls(gm, seq_to_heads_qkv)) == 1 and calls(gm, seq_to_heads) == []
    assert len(sent_to_heads(gm)) == 3
    for inp, out in sent_to_heads(gm):
        assert inp.shape[2] == local and out.shape[2] == seq
    assert calls(gm, gather_seq) == []  # the logits leave as the rank's block of the sequence's length
    assert list(gm.meta["ulysses_report"].sharded_outputs.values()) == [SequenceBlocks(1, 1, 1, seq)]
    assert gm.meta["ulysses_report"].fallbacks == []


def test_sequence_shorter_than_the_ranks_runs_replicated(fake_group):
    fake_group(4, 3)
    ids, labels = token_batch(seq=2)
    (gm,) = rewritten_graphs(tiny_llama(layers=1), (), {"input_ids": ids, "labels": labels, "use_cache": False})
    assert calls(gm, seq_to_heads) == [] and calls(gm, seq_to_heads_qkv) == [] and calls(gm, gather_seq) == []
    assert gm.meta["ulysses_report"].replicated == "a sequence of 2 positions is shorter than the 4 sequence-parallel ranks"


@pytest.mark.parametrize("name", sorted(model_zoo()))
@pytest.mark.parametrize("world_size", [2, 4])
def test_model_zoo_is_parallelized_without_fallbacks(fake_group, name, world_size):
    fake_group(world_size)
    factory, kind = model_zoo()[name]
    model = factory()
    (gm,) = rewritten_graphs(model, (), zoo_inputs(kind))
    layers = model.config.num_hidden_layers
    kv_heads = getattr(model.config, "num_key_value_heads", None) or model.config.num_attention_heads
    if name == "falcon_mqa":
        kv_heads = 1
    kv_by_all_to_all = kv_heads % world_size == 0
    # KV heads that split like the query heads travel with them: one all-to-all for q, k and v; else
    # q alone goes by all-to-all and each rank gathers the KV heads its query heads use
    assert len(calls(gm, seq_to_heads_qkv)) == (layers if kv_by_all_to_all else 0)
    assert len(calls(gm, seq_to_heads)) == (0 if kv_by_all_to_all else layers)
    assert len(calls(gm, heads_to_seq)) == layers
    assert len(calls(gm, gather_kv_heads)) == (0 if kv_by_all_to_all else 2 * layers)
    if kv_by_all_to_all:  # q, k, v with all their (un-repeated) heads; the output with H/P
        heads = model.config.num_attention_heads
        assert [inp.shape[1] for inp, _ in sent_to_heads(gm)] == [heads, kv_heads, kv_heads] * layers
        assert [n.args[0].meta["val"].shape[1] for n in calls(gm, heads_to_seq)] == [heads // world_size] * layers
    assert gm.meta["ulysses_report"].fallbacks == []  # gpt-oss's MoE blocks too


def test_mean_over_the_sequence_is_a_partial_sum(fake_group):
    fake_group(4)
    torch.manual_seed(0)
    (gm,) = rewritten_graphs(MeanPooledClassifier(), (torch.randint(0, 128, (2, 64)), torch.tensor([1, 2])))
    assert calls(gm, gather_seq) == [] and gm.meta["ulysses_report"].fallbacks == []
    (pooled,) = calls(gm, reduce_partial)
    assert tuple(pooled.meta["val"].shape) == (2, 64)  # [B, hidden]: the only extra communication


def test_a_cumsum_is_completed_once_for_all_its_readers(fake_group):
    from op_probes import PROBES

    from ulysses_compile.core.collectives import add_previous_ranks_totals

    fake_group(2)
    (gm,) = rewritten_graphs(PROBES["cumsum_in_place_reused"](), (torch.randint(0, 32, (2, 16)),))
    (completion,) = calls(gm, add_previous_ranks_totals)
    assert any(user.target == "mul_" for user in completion.users)  # the write lands on what readers read


@pytest.mark.parametrize("probe,viewed_by", [("view_read_after_its_base_is_written", "following"),
                                              ("written_through_a_shifted_view", "getitem_3")])
def test_a_value_written_in_place_and_viewed_by_a_fallback_is_kept_whole(fake_group, probe, viewed_by):
    """A view that falls back would view a gathered copy, missing later writes to its base (or taking a
    write through it): the base is computed whole instead, so the view is a real one, and reported."""
    from op_probes import PROBES

    fake_group(2)
    (gm,) = rewritten_graphs(PROBES[probe](), (torch.randint(0, 32, (2, 15)),))
    report = gm.meta["ulysses_report"]
    assert len(report.attention_sites) == 1 and len(calls(gm, heads_to_seq)) == 1
    kept = [fallback for fallback in report.fallbacks if "so it is kept whole" in fallback.reason]
    assert len(kept) == 1 and f"viewed by {viewed_by}," in kept[0].reason, report.fallbacks
    (base,) = [node for node in gm.graph.nodes if node.name == kept[0].node]
    (view,) = [node for node in gm.graph.nodes if node.name == viewed_by]
    assert view.args[0] is base and not is_rank_local(sharding_of(base).output)  # a real view, no copy between


def test_an_attention_output_written_in_place_and_viewed_by_a_fallback_is_refused(fake_group):
    class WrittenAttention(nn.Module):
        def forward(self, q):
            y = F.scaled_dot_product_attention(q, q, q, is_causal=True)
            tail = y[:, :, 1:]  # a view with no sharded form, taken before the write
            y.mul_(0.5)
            return F.pad(tail, (0, 0, 0, 1)) + y

    fake_group(2)
    with pytest.raises(Exception, match=r"is written in place and viewed by tail .*write it out of place"):
        rewritten_graphs(WrittenAttention(), (torch.randn(1, 2, 15, 8),))


def test_a_new_buffer_of_a_sharded_value_is_made_in_blocks(fake_group):
    from op_probes import PROBES

    fake_group(2)
    (gm,) = rewritten_graphs(PROBES["halves_into_new_buffer"](), (torch.randint(0, 32, (2, 15)),))
    assert gm.meta["ulysses_report"].fallbacks == [] and calls(gm, gather_seq) == []
    (made,) = [node for node in gm.graph.nodes if node.target == "new_empty"]
    assert tuple(made.meta["val"].shape)[1] == 8  # rank 0's block of 15 positions


def test_parts_of_a_localized_op_stay_in_its_checkpointed_region(fake_group):
    from torch.utils.checkpoint import checkpoint

    from op_probes import Probe

    from ulysses_compile.core.compat import recompute_region

    class Checkpointed(Probe):
        def forward(self, ids):
            return checkpoint(super().forward, ids, use_reentrant=False)

    fake_group(2)
    (gm,) = rewritten_graphs(Checkpointed(lambda h: h * h.mean(1, keepdim=True)), (torch.randint(0, 32, (2, 16)),))
    (summed,) = [node for node in gm.graph.nodes if node.target == "sum"]
    assert recompute_region(summed) == 1 and "h.mean(1, keepdim=True)" in summed.meta["stack_trace"]


def test_in_place_write_without_a_sharded_form_is_an_error(fake_group):
    from op_probes import Probe

    def write_by_index(h):
        h.index_fill_(1, torch.tensor([0]), 0.0)  # along the sharded sequence: no local form
        return h

    fake_group(2)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as raised:
        rewritten_graphs(Probe(write_by_index), (torch.randint(0, 32, (2, 16)),))
    error = raised.value.inner_exception
    assert isinstance(error, UnsupportedError)
    assert "writes in place into" in str(error) and "write it out of place" in str(error)


def test_handwritten_attention_runs_on_heads(fake_group):
    from op_probes import ManualAttention

    fake_group(2)
    torch.manual_seed(0)
    (gm,) = rewritten_graphs(ManualAttention(), (torch.randn(2, 32, 16),))
    report = gm.meta["ulysses_report"]
    assert [site.spelling for site in report.attention_sites] == ["matmul_softmax"]
    assert report.fallbacks == [] and calls(gm, gather_seq) == [] and len(report.sharded_outputs) == 1
    assert len(calls(gm, seq_to_heads_qkv)) == 1 and calls(gm, seq_to_heads) == []  # q, k, v exist before q @ k^T
    shapes = [(tuple(inp.shape), tuple(out.shape)) for inp, out in sent_to_heads(gm)]
    shapes += [(tuple(n.args[0].meta["val"].shape), tuple(n.meta["val"].shape)) for n in calls(gm, heads_to_seq)]
    assert shapes == [
        ((2, 2, 16, 8), (2, 1, 32, 8)),  # q: sequence -> heads
        ((2, 2, 16, 8), (2, 1, 32, 8)),  # k, before its transpose
        ((2, 2, 16, 8), (2, 1, 32, 8)),  # v
        ((2, 1, 32, 8), (2, 2, 16, 8)),  # the output: heads -> sequence
    ], shapes


def _sdpa_masks(gm) -> list:
    from ulysses_compile.passes.attention_forms.sdpa import SDPA_TARGETS, sdpa_arguments

    calls = [sdpa_arguments(n) for n in gm.graph.nodes if n.op == "call_function" and n.target in SDPA_TARGETS]
    return [("causal" if call.get("is_causal") else None, call.get("attn_mask")) for call in calls]


class BandedAttention(nn.Module):
    """A mask built from aranges that is not plain causal: each token sees itself and 3 before."""

    def __init__(self, dim: int = 32, heads: int = 4):
        super().__init__()
        self.heads, self.qkv = heads, nn.Linear(dim, 3 * dim)

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        positions = torch.arange(x.shape[1])
        band = (positions[None, :] <= positions[:, None]) & (positions[:, None] - positions[None, :] < 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=band).transpose(1, 2).flatten(2)


def test_a_causal_mask_built_from_positions_alone_becomes_is_causal(fake_group):
    fake_group(2)
    ids, labels = token_batch(seq=32)
    (gm,) = rewritten_graphs(tiny_llama(layers=2), (), {"input_ids": ids, "labels": labels, "use_cache": False})
    assert _sdpa_masks(gm) == [("causal", None)] * 2
    assert "le" not in [n.target.__name__ for n in gm.graph.nodes if n.op == "call_function" and
                        hasattr(n.target, "__name__")]  # the mask's comparison of positions is gone
    # A mask built from positions the caller passes depends on their values: kept.
    positions = torch.arange(32).expand(2, -1)
    (gm,) = rewritten_graphs(tiny_llama(layers=1), (), {"input_ids": ids, "position_ids": positions,
                                                         "use_cache": False})
    ((causal, mask),) = _sdpa_masks(gm)
    assert causal is None and mask is not None
    (gm,) = rewritten_graphs(BandedAttention(), (torch.randn(2, 32, 32),))
    ((causal, mask),) = _sdpa_masks(gm)
    assert causal is None and mask is not None


def test_complex_rotary_embedding_keeps_the_sequence_sharded(fake_group):
    """torchtitan's and gpt-fast's RoPE: view_as_complex, a complex product with a sliced freqs_cis
    table, view_as_real. q and k are rotated on the rank's block, then turned to heads."""
    from op_probes import PROBES

    fake_group(2)
    (gm,) = rewritten_graphs(PROBES["complex_rotary"](), (torch.randint(0, 32, (2, 15)),))
    report = gm.meta["ulysses_report"]
    assert len(report.attention_sites) == 1 and "parallelized" in report.attention_sites[0].decision
    assert len(calls(gm, seq_to_heads_qkv)) == 1 and calls(gm, seq_to_heads) == [] and len(calls(gm, heads_to_seq)) == 1
    assert report.fallbacks == [] and calls(gm, gather_seq) == [] and len(report.sharded_outputs) == 1


def test_attention_with_sinks_is_parallel_from_the_embedding_on(fake_group):
    """The max subtracted from the joined scores is computed from them: it is no mask entering the
    site, so what feeds q, k and v (the embedding) stays sequence-sharded, and the sinks follow the heads."""
    from op_probes import PROBES

    from ulysses_compile.core.collectives import scatter_seq

    fake_group(2)
    (gm,) = rewritten_graphs(PROBES["attention_sinks"](), (torch.randint(0, 32, (2, 15)),))
    report = gm.meta["ulysses_report"]
    assert len(report.attention_sites) == 1 and "parallelized" in report.attention_sites[0].decision
    (embedding,) = calls(gm, F.embedding)
    assert embedding.args[0].target is scatter_seq and embedding.args[0].args[0].op == "placeholder"
    # the only other slice: the sinks, to the rank's heads
    assert [node.args[0].target for node in calls(gm, scatter_seq)][1:] == ["expand"]
    assert len(calls(gm, seq_to_heads_qkv)) == 1 and calls(gm, seq_to_heads) == []
    assert len(calls(gm, heads_to_seq)) == 1 and report.fallbacks == []


class _ScaledByFirstRow(torch.autograd.Function):
    """Not elementwise: every position is scaled by row 0 of a table that spans the sequence."""

    @staticmethod
    def forward(ctx, x, table):
        ctx.save_for_backward(table)
        return x * table[0]

    @staticmethod
    def backward(ctx, grad):
        (table,) = ctx.saved_tensors
        return grad * table[0], None


def test_an_autograd_function_that_indexes_a_tensor_is_not_taken_as_elementwise(fake_group):
    """Bloom's GeLU (forward and backward elementwise) runs on the rank's block (the forms' test); a
    Function that reads ``table[0]`` would read the rank's own first row there: it takes its inputs whole."""

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.table = nn.Linear(16, 48), nn.Parameter(torch.randn(8, 16))

        def forward(self, x):
            q, k, v = self.qkv(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 8, 16)
            return _ScaledByFirstRow.apply(out, self.table)

    fake_group(2)
    torch.manual_seed(0)
    (gm,) = rewritten_graphs(Model(), (torch.randn(2, 8, 16),))
    assert [fallback.op for fallback in gm.meta["ulysses_report"].fallbacks] == ["autograd_function_apply"]
