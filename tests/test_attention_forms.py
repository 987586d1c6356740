"""Every attention form real code uses: found (or rejected with a reason) in one process, and equal to
eager on real gloo ranks."""

from __future__ import annotations

import copy

import pytest
import torch

from attention_forms import FORMS, outputs_of
from multirank import assert_close, compare_model, run_ranks
from graphs import calls, rewritten_graphs, sent_to_heads
from ulysses_compile.core.boundary import SequenceBlocks
from ulysses_compile.core.collectives import gather_kv_heads, gather_seq, heads_to_seq, seq_to_heads, seq_to_heads_qkv

SDPA = "scaled_dot_product_attention"
# name -> (site forms, how q, k and v reach heads at P = 4): "one" all-to-all for the three
# (seq_to_heads_qkv), one all-to-all "each" (seq_to_heads: v does not exist yet where q and k are used),
# or q by all-to-all and the KV heads "gathered" (gather_kv_heads: they do not split like the query heads)
EXPECTED = {
    "nanogpt_manual": (["matmul_softmax"] * 2, "one"),
    "einsum_bshd": (["einsum_softmax"], "one"),
    "baddbmm_merged_heads": (["baddbmm_softmax_bmm"], "one"),
    "sink_scaled_output": (["matmul_softmax"], "one"),
    "views_between_the_products": (["baddbmm_softmax_bmm"], "one"),
    "views_between_the_products_6_heads": (["baddbmm_softmax_bmm"], "one"),
    "llama_eager_gqa_gathered": (["matmul_softmax"], "gathered"),
    "llama_6_heads": ([SDPA], "one"),
    "llama_6_heads_gqa_3": ([SDPA], "gathered"),
    "llama_mqa": ([SDPA], "gathered"),
    "nn_mha_key_padding": ([SDPA], "one"),
    "nn_transformer_cross_attention": ([SDPA] * 3, "one"),
    "sdpa_gqa_bool_mask": ([SDPA], "gathered"),
    "sdpa_per_head_bias_6_heads": ([SDPA], "one"),
    "other_spellings": (["matmul_softmax"] * 3, "one"),
    "key_transposed_by_its_permute": (["matmul_softmax"], "one"),
    "flex_documents_alibi": (["flex_attention"], "one"),
    "attention_weights_returned": (["matmul_softmax"], "one"),
    "value_after_scores": (["matmul_softmax"], "each"),
    "not_attention_softmax_over_queries": (["einsum_softmax"], "one"),
    "sdpa_without_head_dim": (["einsum_softmax"], "one"),
    "flash_attn": (["flash_attn"], "one"),
    "flash_attn_gqa_alibi_window": (["flash_attn"], "gathered"),
}
# per site: (seq_to_heads_qkv, seq_to_heads, gather_kv_heads) calls
CALLS_PER_SITE = {"one": (1, 0, 0), "each": (0, 3, 0), "gathered": (0, 1, 2)}
# forms whose other ops run on the rank's heads too, not gathered: the all-to-alls there and back
OFF_SEQUENCE = {"not_attention_softmax_over_queries": 2}


def test_every_form_has_an_expectation():
    assert sorted(EXPECTED) == sorted(FORMS)


@pytest.mark.parametrize("name", sorted(FORMS))
def test_form_is_found_at_four_ranks(fake_group, name):
    fake_group(4)
    model, args, kwargs = FORMS[name]()
    graphs = rewritten_graphs(model, args, kwargs)
    sites = [site for gm in graphs for site in gm.meta["ulysses_report"].attention_sites]
    forms, how = EXPECTED[name]
    assert [site.spelling for site in sites] == forms
    gm = graphs[0]
    counted = [len(calls(gm, fn)) for fn in (seq_to_heads_qkv, seq_to_heads, gather_kv_heads)]
    expected = [len(sites) * count for count in CALLS_PER_SITE[how]]
    expected[1] += OFF_SEQUENCE.get(name, 0)
    assert counted == expected, counted
    assert len(calls(gm, heads_to_seq)) == len(sites)
    report = gm.meta["ulysses_report"]
    assert report.fallbacks == [] or name == "sdpa_without_head_dim", report.fallbacks
    assert bool(report.off_sequence) == (name in OFF_SEQUENCE), report.off_sequence


def test_softmax_over_queries_is_rejected_with_the_reason(fake_group):
    fake_group(2)
    model, args, kwargs = FORMS["not_attention_softmax_over_queries"]()
    (gm,) = rewritten_graphs(model, args, kwargs)
    (rejected,) = gm.meta["ulysses_report"].rejected_attention
    assert rejected.startswith("mixing") and "softmax runs over dim -2, not over the key positions" in rejected
    # the mixing layer still runs split: on the rank's heads, whole along the sequence
    (moved,) = gm.meta["ulysses_report"].off_sequence
    assert moved == "the model: h [2, 4, 32, 8] to dim 1, transpose_1 [2, 4, 8, 32] to dim 1", moved


def test_a_key_already_transposed_by_its_layout_is_rejected_with_the_reason(fake_group):
    """k^T unbound from one tensor with q and v (no transpose node to read): reported, computed whole."""

    class UnboundKeyTransposed(torch.nn.Module):
        def forward(self, qkv):
            q, key_transposed, v = qkv.unbind(0)
            return torch.softmax(q @ key_transposed, dim=-1) @ v

    fake_group(2)
    (gm,) = rewritten_graphs(UnboundKeyTransposed(), (torch.randn(3, 2, 4, 16, 16),))
    (rejected,) = gm.meta["ulysses_report"].rejected_attention
    assert "the second operand of q @ k^T is not k transposed" in rejected


def test_sdpa_without_a_head_dim_is_rejected_with_the_reason(fake_group):
    fake_group(2)
    model, args, kwargs = FORMS["sdpa_without_head_dim"]()
    (gm,) = rewritten_graphs(model, args, kwargs)
    report = gm.meta["ulysses_report"]
    assert len(report.rejected_attention) == 2, report.rejected_attention
    assert all("on a query of shape [32, 32] has no head dim to split" in line for line in report.rejected_attention)
    assert [fallback.op for fallback in report.fallbacks] == ["scaled_dot_product_attention"] * 2, report.fallbacks


def test_transformer_encoder_with_its_default_dropout_is_parallel(fake_group):
    """``nn.TransformerEncoderLayer``'s default ``dropout=0.1`` includes the attention's, inside SDPA's
    kernel: each site runs split over heads with its draws seeded apart per rank."""
    from ulysses_compile.core.runtime import attention_heads_dropout

    fake_group(2)
    torch.manual_seed(0)
    model = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 2).train()
    (gm,) = rewritten_graphs(model, (torch.randn(2, 16, 32),))
    report = gm.meta["ulysses_report"]
    assert len(report.attention_sites) == 2 and not report.replicated, str(report)
    assert len(calls(gm, attention_heads_dropout)) == 2 and len(calls(gm, heads_to_seq)) == 2


def test_flash_attn_dropout_inside_the_kernel_runs_whole_with_the_reason(fake_group):
    """flash-attn draws its dropout from the CUDA generator inside the kernel, where no seed can be set
    apart per rank: split over heads the ranks would share masks, so the site runs whole (SDPA's dropout
    runs split: test_input_agreement)."""
    import functools

    fake_group(2)
    model, args, kwargs = FORMS["flash_attn"]()
    model.attention = functools.partial(model.attention, dropout_p=0.5)
    (gm,) = rewritten_graphs(model, args, kwargs)
    report = gm.meta["ulysses_report"]
    assert not report.attention_sites and report.replicated, str(report)
    (rejected,) = report.rejected_attention
    assert "flash-attn's dropout inside the kernel (dropout_p=0.5) would draw the same mask" in rejected, rejected


def test_reused_attention_weights_are_gathered_whole(fake_group):
    fake_group(4, rank=3)
    model, args, kwargs = FORMS["attention_weights_returned"]()
    (gm,) = rewritten_graphs(model, args, kwargs, outputs="gather")
    weights = [n for n in calls(gm, gather_seq) if n.meta["val"].dim() == 4]
    assert [tuple(n.args[0].meta["val"].shape) for n in weights] == [(2, 1, 32, 32)]  # this rank's head
    assert [tuple(n.meta["val"].shape) for n in weights] == [(2, 4, 32, 32)]
    torch.compiler.reset()
    (gm,) = rewritten_graphs(model, args, kwargs)  # by default they leave as this rank's head, gathered when read
    assert SequenceBlocks(1, 1, 1, 4) in gm.meta["ulysses_report"].sharded_outputs.values()
    assert not [n for n in calls(gm, gather_seq) if n.meta["val"].dim() == 4]


def test_cross_attention_sends_each_sequence_with_its_own_length(fake_group):
    """q (16 target positions), k and v (32 source positions) in one all-to-all, each of its own length."""
    fake_group(4)
    model, args, kwargs = FORMS["nn_transformer_cross_attention"]()
    (gm,) = rewritten_graphs(model, args, kwargs)
    cross = gm.meta["ulysses_report"].attention_sites[-1]
    assert cross.module == "decoder.layers.0.multihead_attn" and (cross.seq_len, cross.kv_seq_len) == (16, 32)
    fused = calls(gm, seq_to_heads_qkv)
    assert len(fused) == 3 and calls(gm, seq_to_heads) == []  # encoder, decoder self- and cross-attention
    assert [(n.kwargs["seq_len"], n.kwargs["kv_seq_len"]) for n in fused] == [(32, 32), (16, 16), (16, 32)]
    sent = [(tuple(inp.shape), tuple(out.shape)) for inp, out in sent_to_heads(gm)]
    assert sent[-3:] == [((2, 4, 4, 8), (2, 1, 16, 8)), ((2, 4, 8, 8), (2, 1, 32, 8)), ((2, 4, 8, 8), (2, 1, 32, 8))]
    items = sorted(fused[-1].users, key=lambda item: item.args[1])  # what the cross-attention reads: q, k, v
    assert [tuple(item.meta["val"].shape) for item in items] == [(2, 1, 16, 8), (2, 1, 32, 8), (2, 1, 32, 8)]


def test_multi_head_attention_weights_in_use_run_replicated_with_the_reason(fake_group):
    fake_group(2)

    class WeightsUsed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = torch.nn.MultiheadAttention(32, 4, batch_first=True)

        def forward(self, x):
            out, weights = self.mha(x, x, x)
            return out * weights.mean()

    torch.manual_seed(0)
    graphs = rewritten_graphs(WeightsUsed(), (torch.randn(2, 16, 32),))
    report = graphs[0].meta["ulysses_report"]
    assert report.attention_sites == []
    (rejected,) = report.rejected_attention
    assert "the attention weights are used (need_weights=True); pass need_weights=False" in rejected


def test_site_summary_names_layout_mask_and_decision(fake_group):
    fake_group(4)
    model, args, kwargs = FORMS["flash_attn_gqa_alibi_window"]()
    (gm,) = rewritten_graphs(model, args, kwargs)
    (site,) = gm.meta["ulysses_report"].attention_sites
    assert site.summary().endswith(
        "flash_attn [B, S, H, D], heads 4 (kv 2), head_dim 8, seq 32, mask causal, window (8, -1), alibi [4]; "
        "parallelized: heads per rank 1,1,1,1, key/value gathered per query head"
    )


def forms_equal_to_eager(rank, world_size, names, compiler):
    for name in names:
        model, args, kwargs = FORMS[name]()
        reference = copy.deepcopy(model)
        torch.compiler.reset()
        compiled = torch.compile(model, backend="ulysses", options={"compiler": compiler})
        got = outputs_of(compiled(*args, **kwargs))
        want = outputs_of(reference(*args, **kwargs))
        if not any(parameter.requires_grad for parameter in model.parameters()):
            for key in got:  # a frozen form: FlexAttention, which has no CPU backward (tests/test_gpu.py)
                assert_close(f"rank {rank} {name} {key}", got[key], want[key])
            continue
        got["loss"].backward()
        want["loss"].backward()
        compare_model(rank, model, reference, {f"{name} {key}": (got[key], want[key]) for key in got})


@pytest.mark.multirank
@pytest.mark.parametrize("name", sorted(FORMS))
def test_form_equal_to_eager_at_four_ranks(name):
    run_ranks(forms_equal_to_eager, 4, [name], "aot_eager")


@pytest.mark.multirank
@pytest.mark.slow  # Inductor compiles five models on two ranks (about 3 minutes); every form runs at P = 4 above
def test_forms_through_inductor_at_two_ranks():
    names = ["nanogpt_manual", "einsum_bshd", "flash_attn_gqa_alibi_window", "llama_eager_gqa_gathered",
             "nn_transformer_cross_attention"]
    run_ranks(forms_equal_to_eager, 2, names, "inductor")


def test_a_split_that_meets_a_size_read_from_data_runs_the_graph_whole(fake_group, monkeypatch):
    """Sizes read with ``.item()``/``.tolist()`` are unbacked ints in the graph (the backend's tracing
    settings); a decision of the split that would need one's value raises torch's data-dependent guard
    error. The graph then runs whole, as captured, each site reported with the reason; no compile
    fails. (Forced here on a plain model: the rules that meet such sizes decide without guards.)"""
    import sympy

    import ulysses_compile.passes.pipeline as pipeline
    from ulysses_compile.core.compat import GuardOnDataDependentSymNode

    def meets_a_size_read_from_data(gm, ctx, sites):
        raise GuardOnDataDependentSymNode(sympy.Eq(sympy.Symbol("u0"), 0), "Could not guard on u0")

    fake_group(2)
    monkeypatch.setattr(pipeline, "propagate_sharding", meets_a_size_read_from_data)
    model, args, kwargs = FORMS["llama_6_heads"]()
    (gm,) = rewritten_graphs(model, args, kwargs)
    report = gm.meta["ulysses_report"]
    assert report.replicated.startswith("a size read from data") and not report.attention_sites, str(report)
    assert len(report.rejected_attention) == 1 and "Could not guard on u0" in report.rejected_attention[0]
    assert report.collectives == [] and not calls(gm, seq_to_heads_qkv), str(report)


def test_merged_heads_with_shared_key_value_heads_are_rejected_with_the_reason(fake_group):
    """Bloom's layout with one key/value head repeated for the query heads (``repeat_interleave`` on the
    merged dim): not built for merged heads, so the site runs whole, reported."""

    class SharedKeyValue(torch.nn.Module):
        def forward(self, q, kv):
            b, heads, s = 2, 4, q.shape[1]
            k = v = kv.repeat_interleave(heads, dim=0)
            scores = torch.bmm(q, k.transpose(1, 2)).view(b, heads, s, s)
            return torch.bmm(scores.softmax(-1).view(b * heads, s, s), v)

    fake_group(2)
    (gm,) = rewritten_graphs(SharedKeyValue(), (torch.randn(8, 16, 8), torch.randn(2, 16, 8)))
    (rejected,) = gm.meta["ulysses_report"].rejected_attention
    assert "heads merged with the batch" in rejected and "fewer key/value heads" in rejected, rejected
