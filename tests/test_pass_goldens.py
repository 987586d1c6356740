"""What each pass does to a small graph, pinned: the lines a pass removes (-) and adds (+) in the code
of a model chosen to exercise it, at P = 2 on a fake process group; for passes that only annotate nodes,
the annotations. Each pass's docstring points here. Regenerate after an intended change with
``EXPECTTEST_ACCEPT=1 pytest tests/test_pass_goldens.py`` and read the diff.

``inline_checkpoint_regions`` is pinned in ``tests/test_checkpointing.py``; ``check_local_shapes``
only checks (its code after equals its code before)."""

from __future__ import annotations

import difflib
import operator
import re

import torch
import torch.nn as nn
import torch.nn.functional as F
from expecttest import assert_expected_inline

from attention_forms import FORMS
from graphs import calls, rewritten_graphs
import ulysses_compile.passes.pipeline
from ulysses_compile.core.collectives import gather_seq
from ulysses_compile.core.compat import recompute_region

DIM, HEADS, SEQ = 16, 2, 8


class SDPAttention(nn.Module):
    """One causal SDPA attention between two projections."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.out = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        return self.out(self.attend(q, k, v).transpose(1, 2).reshape(b, s, d))

    def attend(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class MaskedAttention(SDPAttention):
    """A boolean causal mask built from aranges, as transformers builds it."""

    def attend(self, q, k, v):
        positions = torch.arange(q.shape[2], device=q.device)
        mask = (positions[None, :] <= positions[:, None])[None, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class DroppedMask(SDPAttention):
    """A mask built from positions and then not used, as transformers does where its window covers the
    sequence: the positions also reach the queries (a position embedding), so they are sharded."""

    def attend(self, q, k, v, past_tokens=0):
        positions = torch.arange(q.shape[2], device=q.device) + past_tokens
        torch.diff(positions, prepend=positions[:1] - 1) != 1  # built, then not read
        return F.scaled_dot_product_attention(q + positions[:, None] * 1e-3, k, v, is_causal=True)


class HandwrittenAttention(SDPAttention):
    def attend(self, q, k, v):
        return torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1) @ v


class TokenLoss(SDPAttention):
    """Attention, then a mean cross-entropy over every position."""

    def forward(self, x, labels):
        return F.cross_entropy(super().forward(x).flatten(0, 1), labels.flatten())


class TokenLossAndLogits(SDPAttention):
    """The loss and the logits it is computed from, as a model called with labels returns them."""

    def forward(self, x, labels):
        logits = super().forward(x)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits


class CachedAttention(SDPAttention):
    """Attention that returns the keys and values it read, as a key/value cache."""

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        return self.out(self.attend(q, k, v).transpose(1, 2).reshape(b, s, d)), k, v


class MultiHeadAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(DIM, HEADS, bias=False, batch_first=True)

    def forward(self, x):
        return self.mha(x, x, x, need_weights=False)[0]


def _features():
    return torch.randn(2, SEQ, DIM, generator=torch.Generator().manual_seed(0))


def _report(fake_group, model, *args, **options):
    fake_group(2)
    torch.manual_seed(0)
    (gm,) = rewritten_graphs(model, args, **options)
    return gm, gm.meta["ulysses_report"]


def _lines(code: str) -> list[str]:
    code = re.sub(r";  [\w =]+ = None", "", code)
    return [line.rstrip() for line in code.strip().splitlines() if line.strip()]


def _changes(report, graph_pass) -> str:
    """The lines ``graph_pass`` removed and added, in order, from the code before it to the code after."""
    names = list(report.graphs)  # in the order the passes ran
    index = names.index(graph_pass)
    before = report.graphs[names[index - 1]] if index else report.captured
    diff = difflib.unified_diff(_lines(before), _lines(report.graphs[graph_pass]), lineterm="", n=0)
    return "\n".join(line for line in diff if line[:1] in "+-" and line[:3] not in ("---", "+++"))


def _is_collective(node) -> bool:
    """A call the passes inserted from ulysses_compile.core.collectives (collectives, and the free slice)."""
    return getattr(node.target, "__module__", None) == "ulysses_compile.core.collectives"


def _annotated(gm, describe) -> str:
    return "\n".join(f"{node.name}: {text}" for node in gm.graph.nodes if (text := describe(node)) is not None)


def test_decompose_multi_head_attention(fake_group):
    _, report = _report(fake_group, MultiHeadAttention(), _features())
    assert_expected_inline(_changes(report, "decompose_multi_head_attention"), """\
-    multi_head_attention_forward = torch.nn.functional.multi_head_attention_forward(query, query, query, 16, 2, l_self_modules_mha_parameters_in_proj_weight_, None, None, None, False, 0.0, l_self_modules_mha_modules_out_proj_parameters_weight_, None, training = True, key_padding_mask = None, need_weights = False, attn_mask = None, average_attn_weights = True, is_causal = False)
-    attn_output = multi_head_attention_forward[0]
-    attn_output_1 = attn_output.transpose(1, 0)
+    chunk = l_self_modules_mha_parameters_in_proj_weight_.chunk(3)
+    getitem_1 = chunk[0]
+    getitem_2 = chunk[1]
+    getitem_3 = chunk[2]
+    linear = torch._C._nn.linear(query, getitem_1, None)
+    view = linear.view(8, 2, 2, 8)
+    permute = view.permute(1, 2, 0, 3)
+    linear_1 = torch._C._nn.linear(query, getitem_2, None)
+    view_1 = linear_1.view(8, 2, 2, 8)
+    permute_1 = view_1.permute(1, 2, 0, 3)
+    linear_2 = torch._C._nn.linear(query, getitem_3, None)
+    view_2 = linear_2.view(8, 2, 2, 8)
+    permute_2 = view_2.permute(1, 2, 0, 3)
+    scaled_dot_product_attention = torch._C._nn.scaled_dot_product_attention(permute, permute_1, permute_2, attn_mask = None, dropout_p = 0.0, is_causal = False)
+    permute_3 = scaled_dot_product_attention.permute(2, 0, 1, 3)
+    reshape = permute_3.reshape(8, 2, 16)
+    linear_3 = torch._C._nn.linear(reshape, l_self_modules_mha_modules_out_proj_parameters_weight_, None)
+    attn_output_1 = linear_3.transpose(1, 0)""")


def test_recognize_flash_attention(fake_group):
    model, args, _ = FORMS["flash_attn"]()
    _, report = _report(fake_group, model, *args)
    assert_expected_inline(_changes(report, "recognize_flash_attention"), """\
-    fwd_body_0 = self.fwd_body_0
-    bwd_body_0 = self.bwd_body_0
-    autograd_function_apply = torch.ops.higher_order.autograd_function_apply(fwd_body_0, bwd_body_0, q, k, v, non_differentiable_idx = [], saved_for_backward_idx = [0, 1, 2, 3, 4, 5])
-    getitem_2 = autograd_function_apply[0]
-    reshape = getitem_2.reshape(2, 32, 32)
+    flash_attention = ulysses_compile_core_runtime_flash_attention(q, k, v, dropout_p = 0.0, softmax_scale = 0.3535533905932738, causal = True, window_size = (-1, -1), softcap = 0.0, alibi_slopes = None, deterministic = False)
+    reshape = flash_attention.reshape(2, 32, 32)""")


def test_recognize_causal_mask(fake_group):
    _, report = _report(fake_group, MaskedAttention(), _features())
    assert_expected_inline(_changes(report, "recognize_causal_mask"), """\
-    positions = torch.arange(8, device = device(type='cpu'))
-    getitem_3 = positions[(None, slice(None, None, None))]
-    getitem_4 = positions[(slice(None, None, None), None)]
-    le = getitem_3 <= getitem_4
-    mask = le[(None, None)]
-    scaled_dot_product_attention = torch._C._nn.scaled_dot_product_attention(q, k, v, attn_mask = mask)
+    scaled_dot_product_attention = torch._C._nn.scaled_dot_product_attention(q, k, v, attn_mask = None, is_causal = True)""")


def test_detect_attention(fake_group):
    _, report = _report(fake_group, HandwrittenAttention(), _features())
    assert_expected_inline(_changes(report, "detect_attention"), """\
-    transpose_1 = matmul_1.transpose(1, 2)
+    attention_output = ulysses_compile_core_runtime_attention_output(matmul_1, 1, 2)
+    transpose_1 = attention_output.transpose(1, 2)""")


class ShortConvolution(SDPAttention):
    """A depthwise causal convolution (padded by k - 1 on both sides, its first S outputs kept) before
    the attention, as hybrid models' short convolutions are written."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(DIM, DIM, 4, groups=DIM, padding=3)

    def forward(self, x):
        return super().forward(self.conv(x.transpose(1, 2))[..., :x.shape[1]].transpose(1, 2))


def test_recognize_causal_convolution(fake_group):
    gm, report = _report(fake_group, ShortConvolution(), _features())
    assert_expected_inline(_changes(report, "recognize_causal_convolution"), """\
-    conv1d = torch.conv1d(transpose, l_self_modules_conv_parameters_weight_, l_self_modules_conv_parameters_bias_, (1,), (3,), (1,), 16)
-    getitem = conv1d[(Ellipsis, slice(None, 8, None))]
-    transpose_1 = getitem.transpose(1, 2)
+    causal_conv1d = ulysses_compile_core_runtime_causal_conv1d(transpose, l_self_modules_conv_parameters_weight_, l_self_modules_conv_parameters_bias_, dilation = 1, groups = 16)
+    transpose_1 = causal_conv1d.transpose(1, 2)""")
    assert report.fallbacks == [] and calls(gm, gather_seq) == []


def test_split_key_permutes(fake_group):
    model, args, _ = FORMS["key_transposed_by_its_permute"]()
    _, report = _report(fake_group, model, *args)
    assert_expected_inline(_changes(report, "split_key_permutes"), """\
-    k_1 = x_1.permute(0, 2, 3, 1)
-    matmul = torch.matmul(q_1, k_1)
+    permute_4 = x_1.permute(0, 2, 1, 3)
+    transpose = permute_4.transpose(-2, -1)
+    matmul = torch.matmul(q_1, transpose)""")
    assert [site.spelling for site in report.attention_sites] == ["matmul_softmax"]


def test_drop_dead_values(fake_group):
    gm, report = _report(fake_group, DroppedMask(), _features())
    assert_expected_inline(_changes(report, "drop_dead_values"), """\
-    getitem_3 = positions[slice(None, 1, None)]
-    sub = getitem_3 - 1
-    diff = torch.diff(positions, prepend = sub)
-    ne = diff != 1""")
    assert report.fallbacks == [] and calls(gm, gather_seq) == []


def test_drop_dead_values_keeps_what_has_effects(fake_group):
    """Unread, but not dead: batch norm's running statistics, a write in place, a random draw, a flag."""

    class Effects(SDPAttention):
        def __init__(self):
            super().__init__()
            self.register_buffer("running_mean", torch.zeros(SEQ))
            self.register_buffer("running_var", torch.ones(SEQ))
            self.register_buffer("steps", torch.zeros(()))

        def attend(self, q, k, v):
            F.batch_norm(q[0, 0], self.running_mean, self.running_var, training=True)
            self.steps.add_(1)
            torch.rand_like(q)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    model = Effects()
    gm, report = _report(fake_group, model, _features())
    assert _changes(report, "drop_dead_values") == ""
    assert model.running_mean.abs().sum() > 0 and model.steps.item() == 1


def test_propagate_sharding(fake_group):
    from ulysses_compile.core.sharding import describe, sharding_of

    gm, _ = _report(fake_group, SDPAttention(), _features())

    def placement(node):  # of the captured nodes: later passes insert the collectives (and their items)
        sharding = sharding_of(node)
        inserted = _is_collective(node) or (node.target is operator.getitem and _is_collective(node.args[0]))
        return None if sharding is None or inserted else describe(sharding.output)

    assert_expected_inline(_annotated(gm, placement), """\
l_x_: R
l_self_modules_qkv_parameters_weight_: R
l_self_modules_out_parameters_weight_: R
linear: S(1)
view: S(1)
permute: S(3)
q: S(2)
k: S(2)
v: S(2)
scaled_dot_product_attention: S(1)
transpose: S(1)
reshape: S(1)
linear_1: S(1)""")


def test_redistribute(fake_group):
    _, report = _report(fake_group, SDPAttention(), _features())
    assert_expected_inline(_changes(report, "redistribute"), """\
-    linear = torch._C._nn.linear(l_x_, l_self_modules_qkv_parameters_weight_, None)
+    rank = ulysses_compile_core_collectives_rank_of_group('0', device(type='cpu'))
+    sync_grad_1 = ulysses_compile_core_collectives_sync_grad(l_self_modules_out_parameters_weight_, group_name = '0')
+    sync_grad = ulysses_compile_core_collectives_sync_grad(l_self_modules_qkv_parameters_weight_, group_name = '0')
+    scatter_seq = ulysses_compile_core_collectives_scatter_seq(l_x_, dim = 1, outer = 1, inner = 1, rank = rank, world_size = 2, group_name = '0')
+    linear = torch._C._nn.linear(scatter_seq, sync_grad, None)
-    linear_1 = torch._C._nn.linear(reshape, l_self_modules_out_parameters_weight_, None)
+    linear_1 = torch._C._nn.linear(reshape, sync_grad_1, None)""")


def test_redistribute_reduces_partial_sums(fake_group):
    labels = torch.randint(0, DIM, (2, SEQ), generator=torch.Generator().manual_seed(1))
    _, report = _report(fake_group, TokenLoss(), _features(), labels)
    assert_expected_inline(_changes(report, "redistribute"), """\
-    linear = torch._C._nn.linear(l_x_, l_self_modules_qkv_parameters_weight_, None)
+    rank = ulysses_compile_core_collectives_rank_of_group('0', device(type='cpu'))
+    sync_grad_1 = ulysses_compile_core_collectives_sync_grad(l_self_modules_out_parameters_weight_, group_name = '0')
+    sync_grad = ulysses_compile_core_collectives_sync_grad(l_self_modules_qkv_parameters_weight_, group_name = '0')
+    scatter_seq = ulysses_compile_core_collectives_scatter_seq(l_x_, dim = 1, outer = 1, inner = 1, rank = rank, world_size = 2, group_name = '0')
+    linear = torch._C._nn.linear(scatter_seq, sync_grad, None)
-    linear_1 = torch._C._nn.linear(reshape, l_self_modules_out_parameters_weight_, None)
+    linear_1 = torch._C._nn.linear(reshape, sync_grad_1, None)
-    cross_entropy_1 = torch.nn.functional.cross_entropy(flatten, flatten_1, ignore_index = -100, reduction = 'sum')
-    counted_tokens = ulysses_compile_core_runtime_counted_tokens(flatten_1, -100, None)
-    cross_entropy = cross_entropy_1 / counted_tokens
+    scatter_seq_1 = ulysses_compile_core_collectives_scatter_seq(flatten_1, dim = 0, outer = 2, inner = 1, rank = rank, world_size = 2, group_name = '0')
+    cross_entropy_1 = torch.nn.functional.cross_entropy(flatten, scatter_seq_1, ignore_index = -100, reduction = 'sum')
+    reduce_partial = ulysses_compile_core_collectives_reduce_partial(cross_entropy_1, group_name = '0')
+    counted_tokens = ulysses_compile_core_runtime_counted_tokens(scatter_seq_1, -100, None)
+    reduce_partial_1 = ulysses_compile_core_collectives_reduce_partial(counted_tokens, group_name = '0')
+    cross_entropy = reduce_partial / reduce_partial_1""")


class GatedMLPBlock(SDPAttention):
    """Attention, then Llama's gated MLP."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(DIM, 2 * DIM, bias=False)
        self.up = nn.Linear(DIM, 2 * DIM, bias=False)
        self.down = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x):
        h = super().forward(x)
        return self.down(F.silu(self.gate(h)) * self.up(h))


def test_tile_mlp(fake_group):
    _, report = _report(fake_group, GatedMLPBlock(), _features(), tile_mlp=True)
    assert_expected_inline(_changes(report, "tile_mlp"), """\
-    linear_2 = torch._C._nn.linear(h, sync_grad_2, None)
-    silu = torch.nn.functional.silu(linear_2)
-    linear_3 = torch._C._nn.linear(h, sync_grad_3, None)
-    mul = silu * linear_3
-    linear_4 = torch._C._nn.linear(mul, sync_grad_4, None)
-    return (linear_4,)
+    tiled_gated_mlp = ulysses_compile_core_runtime_tiled_gated_mlp(h, sync_grad_2, sync_grad_3, sync_grad_4, 'silu')
+    return (tiled_gated_mlp,)""")


def test_tile_token_loss(fake_group):
    labels = torch.randint(0, DIM, (2, SEQ), generator=torch.Generator().manual_seed(1))
    _, report = _report(fake_group, TokenLoss(), _features(), labels)
    assert_expected_inline(_changes(report, "tile_token_loss"), """\
-    flatten = linear_1.reshape((8, 16))
-    cross_entropy_1 = torch.nn.functional.cross_entropy(flatten, scatter_seq_1, ignore_index = -100, reduction = 'sum')
-    reduce_partial = ulysses_compile_core_collectives_reduce_partial(cross_entropy_1, group_name = '0')
+    reshape_1 = reshape.reshape(-1, 16)
+    reshape_2 = linear_1.reshape(-1, 16)
+    token_loss_sum = ulysses_compile_core_runtime_token_loss_sum(reshape_2, reshape_1, sync_grad_1, scatter_seq_1, -100)
+    reduce_partial = ulysses_compile_core_collectives_reduce_partial(token_loss_sum, group_name = '0')""")


def test_return_weight_inputs(fake_group):
    labels = torch.randint(0, DIM, (2, SEQ), generator=torch.Generator().manual_seed(1))
    _, report = _report(fake_group, TokenLossAndLogits(), _features(), labels)
    assert_expected_inline(_changes(report, "return_weight_inputs"), """\
-    return (cross_entropy, reshape, sync_grad_1)
+    return (cross_entropy, reshape, l_self_modules_out_parameters_weight_)""")


def test_average_data_parallel_grads(fake_group):
    from torch.distributed.device_mesh import init_device_mesh

    fake_group(4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
    torch.manual_seed(0)
    (gm,) = rewritten_graphs(SDPAttention(), (_features(),), mesh=mesh)
    assert_expected_inline(_changes(gm.meta["ulysses_report"], "average_data_parallel_grads"), """\
-    sync_grad_1 = ulysses_compile_core_collectives_sync_grad(l_self_modules_out_parameters_weight_, group_name = 'ulysses_sp_621a042e4a2f')
-    sync_grad = ulysses_compile_core_collectives_sync_grad(l_self_modules_qkv_parameters_weight_, group_name = 'ulysses_sp_621a042e4a2f')
+    average_grad_1 = ulysses_compile_core_collectives_average_grad(l_self_modules_out_parameters_weight_, group_name = 'ulysses_dp_621a042e4a2f', group_size = 2)
+    average_grad = ulysses_compile_core_collectives_average_grad(l_self_modules_qkv_parameters_weight_, group_name = 'ulysses_dp_621a042e4a2f', group_size = 2)
+    sync_grad_1 = ulysses_compile_core_collectives_sync_grad(average_grad_1, group_name = 'ulysses_sp_621a042e4a2f')
+    sync_grad = ulysses_compile_core_collectives_sync_grad(average_grad, group_name = 'ulysses_sp_621a042e4a2f')""")


def test_regather_parameters(fake_group):
    from graphs import parallelized_graphs
    from ulysses_compile import parallelize

    fake_group(2)
    torch.manual_seed(0)
    model = parallelize(SDPAttention(), zero_stage=3, compiler="eager")
    gm = parallelized_graphs(model, {"x": _features()}, backward_of=lambda output: output.sum())[0]
    assert_expected_inline(_annotated(gm, lambda node: str(node.meta["recompute"]) if "recompute" in node.meta
                                      else None), """\
gather_parameter: CheckpointPolicy.MUST_RECOMPUTE
gather_parameter_1: CheckpointPolicy.MUST_RECOMPUTE""")


def test_merge_gradient_reductions(fake_group):
    from graphs import parallelized_graphs
    from ulysses_compile import parallelize

    fake_group(2)
    torch.manual_seed(0)
    model = parallelize(SDPAttention(), zero_stage=2, compiler="eager")
    gm = parallelized_graphs(model, {"x": _features()}, backward_of=lambda output: output.sum())[0]
    assert_expected_inline(_changes(gm.meta["ulysses_report"], "merge_gradient_reductions"), """\
-    gather_parameter = ulysses_compile_core_collectives_gather_parameter(l_self_modules_qkv_dict_ulysses_shards_weight_, (48, 16), '0', 2, False, None, None)
-    sync_grad = ulysses_compile_core_collectives_sync_grad(gather_parameter, group_name = '0')
-    linear = torch._C._nn.linear(scatter_seq, sync_grad, None)
+    gather_parameter = ulysses_compile_core_collectives_gather_parameter(l_self_modules_qkv_dict_ulysses_shards_weight_, (48, 16), '0', 2, False, None, None, grad_divisor = 1)
+    linear = torch._C._nn.linear(scatter_seq, gather_parameter, None)
-    gather_parameter_1 = ulysses_compile_core_collectives_gather_parameter(l_self_modules_out_dict_ulysses_shards_weight_, (16, 16), '0', 2, False, None, None)
-    sync_grad_1 = ulysses_compile_core_collectives_sync_grad(gather_parameter_1, group_name = '0')
-    linear_1 = torch._C._nn.linear(reshape, sync_grad_1, None)
+    gather_parameter_1 = ulysses_compile_core_collectives_gather_parameter(l_self_modules_out_dict_ulysses_shards_weight_, (16, 16), '0', 2, False, None, None, grad_divisor = 1)
+    linear_1 = torch._C._nn.linear(reshape, gather_parameter_1, None)""")


def test_insert_all_to_all(fake_group):
    _, report = _report(fake_group, SDPAttention(), _features())
    assert_expected_inline(_changes(report, "insert_all_to_all"), """\
-    scaled_dot_product_attention = torch._C._nn.scaled_dot_product_attention(q, k, v, is_causal = True)
-    transpose = scaled_dot_product_attention.transpose(1, 2)
+    seq_to_heads_qkv = ulysses_compile_core_collectives_seq_to_heads_qkv(q, key = k, value = v, seq_dim = 2, head_dim = 1, seq_len = 8, kv_seq_len = 8, rank = rank, world_size = 2, group_name = '0')
+    getitem_3 = seq_to_heads_qkv[0]
+    getitem_4 = seq_to_heads_qkv[1]
+    getitem_5 = seq_to_heads_qkv[2]
+    scaled_dot_product_attention = torch._C._nn.scaled_dot_product_attention(getitem_3, getitem_4, getitem_5, is_causal = True)
+    heads_to_seq = ulysses_compile_core_collectives_heads_to_seq(scaled_dot_product_attention, seq_dim = 2, head_dim = 1, heads = 2, rank = rank, world_size = 2, group_name = '0')
+    transpose = heads_to_seq.transpose(1, 2)""")


def test_keep_cache_on_heads(fake_group):
    gm, report = _report(fake_group, CachedAttention(), _features())
    assert [report.sharded_outputs[position].dim for position in (1, 2)] == [1, 1], report.sharded_outputs
    assert_expected_inline(_changes(report, "keep_cache_on_heads"), """\
-    return (linear_1, k, v)
+    return (linear_1, getitem_4, getitem_5)""")


def test_insert_all_to_all_under_a_ring(fake_group):
    """2 heads over 4 ranks: Ulysses within groups of 2 over their chunk of 16 positions, a ring of 2."""
    fake_group(4)
    torch.manual_seed(0)
    (gm,) = rewritten_graphs(SDPAttention(), (torch.randn(2, 16, DIM, generator=torch.Generator().manual_seed(0)),))
    assert_expected_inline(_changes(gm.meta["ulysses_report"], "insert_all_to_all"), """\
+    rank_1 = ulysses_compile_core_collectives_rank_of_group('ulysses_heads2_1599362d420c', device(type='cpu'))
-    scaled_dot_product_attention = torch._C._nn.scaled_dot_product_attention(q, k, v, is_causal = True)
-    transpose = scaled_dot_product_attention.transpose(1, 2)
+    seq_to_heads_qkv = ulysses_compile_core_collectives_seq_to_heads_qkv(q, key = k, value = v, seq_dim = 2, head_dim = 1, seq_len = 8, kv_seq_len = 8, rank = rank_1, world_size = 2, group_name = 'ulysses_heads2_1599362d420c')
+    getitem_3 = seq_to_heads_qkv[0]
+    getitem_4 = seq_to_heads_qkv[1]
+    getitem_5 = seq_to_heads_qkv[2]
+    scaled_dot_product_attention = ulysses_compile_core_ring_attention_ring_attention(getitem_3, getitem_4, getitem_5, attn_mask = None, is_causal = True, scale = None, group_name = 'ulysses_ring2_1599362d420c', head_tail = True)
+    heads_to_seq = ulysses_compile_core_collectives_heads_to_seq(scaled_dot_product_attention, seq_dim = 2, head_dim = 1, heads = 2, rank = rank_1, world_size = 2, group_name = 'ulysses_heads2_1599362d420c')
+    transpose = heads_to_seq.transpose(1, 2)""")


def test_plan_sequence_layout(fake_group):
    """A causal ring of 2 over 4 ranks: the graph is left as it is, and the blocks the later passes take
    are the head-tail layout's."""
    fake_group(4)
    torch.manual_seed(0)
    (gm,) = rewritten_graphs(SDPAttention(), (torch.randn(2, 16, DIM, generator=torch.Generator().manual_seed(0)),))
    report = gm.meta["ulysses_report"]
    assert report.graphs["plan_sequence_layout"] == report.graphs["propagate_sharding"]
    taken = [line.strip() for line in _lines(report.graphs["redistribute"]) if "scatter_seq" in line]
    assert_expected_inline("\n".join([report.sequence_layout, *taken]), """\
head-tail over a ring of 2 (ring place i holds chunks i and 3 - i of 4): every attention runs as a causal ring of 2
scatter_seq = ulysses_compile_core_collectives_scatter_seq(l_x_, dim = 1, outer = 1, inner = 1, rank = rank, world_size = 4, group_name = '0', head_tail = 2)
linear = torch._C._nn.linear(scatter_seq, sync_grad, None)""")


def test_localize_ops(fake_group):
    labels = torch.randint(0, DIM, (2, SEQ), generator=torch.Generator().manual_seed(1))
    _, report = _report(fake_group, TokenLoss(), _features(), labels)
    assert_expected_inline(_changes(report, "localize_ops"), """\
-    view = linear.view(2, 8, 3, 2, 8)
+    view = linear.view((2, 4, 3, 2, 8))
-    reshape = transpose.reshape(2, 8, 16)
+    reshape = transpose.reshape((2, 4, 16))
-    flatten = linear_1.flatten(0, 1)
+    flatten = linear_1.reshape((8, 16))
-    cross_entropy = torch.nn.functional.cross_entropy(flatten, flatten_1)
+    cross_entropy_1 = torch.nn.functional.cross_entropy(flatten, flatten_1, ignore_index = -100, reduction = 'sum')
+    counted_tokens = ulysses_compile_core_runtime_counted_tokens(flatten_1, -100, None)
+    cross_entropy = cross_entropy_1 / counted_tokens""")


def test_check_local_shapes_changes_nothing(fake_group):
    _, report = _report(fake_group, SDPAttention(), _features())
    assert _changes(report, "check_local_shapes") == ""


def test_recompute_inserted_nodes(fake_group):
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(SDPAttention):
        def forward(self, x):
            return checkpoint(super().forward, x, use_reentrant=False)

    gm, _ = _report(fake_group, Checkpointed(), _features())
    assert_expected_inline(_annotated(gm, lambda node: f"ac_graph_id={recompute_region(node)}" if (
        _is_collective(node) and recompute_region(node) is not None) else None), """\
seq_to_heads_qkv: ac_graph_id=1
heads_to_seq: ac_graph_id=1""")


def test_every_pass_points_at_its_golden(fake_group):
    import sys

    _, report = _report(fake_group, SDPAttention(), _features())
    assert len(report.graphs) == 22, list(report.graphs)  # every pass of a split graph ran
    for name in report.graphs:
        module = getattr(ulysses_compile.passes.pipeline, name).__module__
        doc = sys.modules[module].__doc__
        assert f"test_pass_goldens.py::test_{name}" in doc or (
            name == "inline_checkpoint_regions" and "tests/test_checkpointing.py" in doc), (
            f"{module}: its docstring does not name its golden")


def test_bucket_zero_gathers(fake_group):
    """Inductor's post-grad pass on three ZeRO gathers, two of layer h.0 and one of h.1: h.0's merge into
    one bucket and h.1's starts before h.0's wait (control dependencies pin the order)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from ulysses_compile.core.compat import c10d_functional
    from ulysses_compile.passes.bucket_zero_gathers import BucketZeroGathers, tag_zero_gather

    group = fake_group(2).group_name

    def program(w_q, w_k, w_q1):
        gathered = [c10d_functional.wait_tensor(c10d_functional.all_gather_into_tensor(shard, 2, group))
                    for shard in (w_q, w_k, w_q1)]
        return gathered[0] @ gathered[1] @ gathered[2]

    gm = make_fx(program, tracing_mode="fake")(*(torch.randn(2, 4) for _ in range(3)))
    units = iter(["h.0", "h.0", "h.1"])
    for node in gm.graph.find_nodes(op="call_function", target=c10d_functional.all_gather_into_tensor.default):
        tag_zero_gather(node, next(units))
    before = gm.code
    BucketZeroGathers()(gm.graph)
    gm.recompile()
    before, after = (_lines(code.replace(repr(group), "group")) for code in (before, gm.code))
    diff = difflib.unified_diff(before, after, lineterm="", n=0)
    assert_expected_inline("\n".join(line for line in diff if line[:1] in "+-" and line[:3] not in ("---", "+++")),
                           """\
-    all_gather_into_tensor = torch.ops._c10d_functional.all_gather_into_tensor.default(w_q_1, 2, group)
-    wait_tensor = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor)
-    all_gather_into_tensor_1 = torch.ops._c10d_functional.all_gather_into_tensor.default(w_k_1, 2, group)
-    wait_tensor_1 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_1)
-    all_gather_into_tensor_2 = torch.ops._c10d_functional.all_gather_into_tensor.default(w_q1_1, 2, group)
+    empty = torch.ops.aten.empty.memory_format([32], dtype = torch.float32, device = device(type='cpu'), pin_memory = False)
+    slice_1 = torch.ops.aten.slice.Tensor(empty, 0, 0, 16)
+    view = torch.ops.aten.view.default(w_q_1, [-1])
+    view_1 = torch.ops.aten.view.default(w_k_1, [-1])
+    cat = torch.ops.aten.cat.default([view, view_1])
+    copy_ = torch.ops.aten.copy_.default(slice_1, cat)
+    all_gather_into_tensor_out = torch.ops._c10d_functional.all_gather_into_tensor_out.default(copy_, 2, group, out = empty)
+    subgraph_all_gather_into_tensor_2 = self.subgraph_all_gather_into_tensor_2
+    all_gather_into_tensor_2 = torch.ops.higher_order.control_deps((all_gather_into_tensor_out,), subgraph_all_gather_into_tensor_2, w_q1_1)
+    subgraph_wait_tensor_3 = self.subgraph_wait_tensor_3
+    wait_tensor_3 = torch.ops.higher_order.control_deps((all_gather_into_tensor_2,), subgraph_wait_tensor_3, all_gather_into_tensor_out)
+    view_2 = torch.ops.aten.view.default(wait_tensor_3, [2, -1])
+    split_with_sizes = torch.ops.aten.split_with_sizes.default(view_2, [8, 8], 1)
+    getitem = split_with_sizes[0]
+    getitem_1 = split_with_sizes[1]
+    clone = torch.ops.aten.clone.default(getitem, memory_format = torch.contiguous_format)
+    _unsafe_view = torch.ops.aten._unsafe_view.default(clone, [4, 4])
+    clone_1 = torch.ops.aten.clone.default(getitem_1, memory_format = torch.contiguous_format)
+    _unsafe_view_1 = torch.ops.aten._unsafe_view.default(clone_1, [4, 4])
-    mm = torch.ops.aten.mm.default(wait_tensor, wait_tensor_1)
+    mm = torch.ops.aten.mm.default(_unsafe_view, _unsafe_view_1)""")
