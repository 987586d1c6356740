"""State-space layers on the rank's heads: a chunked scan (Mamba 2's SSD) runs over the whole sequence
with nothing to split along it, so its inputs go to the rank's heads by all-to-all, as an attention's
q, k and v do, the scan runs unchanged on them, and its output comes back to the rank's block of the
sequence the same way; loss, logits and every gradient equal eager's. Found from the graph: the ops
that would run whole meet in one region, whose inputs share a dim (the heads) the rules keep apart to
its end."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from graphs import rewritten_graphs
from models import token_batch
from multirank import run_ranks, step_against_eager


def tiny_mamba2():
    import transformers

    torch.manual_seed(0)
    return transformers.Mamba2ForCausalLM(transformers.Mamba2Config(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16, expand=2, n_groups=1,
        state_size=8, chunk_size=16, conv_kernel=4))


def segment_sum(x):
    """Sums of ``x`` over every span (i, j], -inf above the diagonal: the decays inside a chunk."""
    length = x.shape[-1]
    x = x[..., None].expand(*x.shape, length)
    x = x.masked_fill(~torch.tril(torch.ones(length, length, dtype=torch.bool), diagonal=-1), 0)
    summed = torch.cumsum(x, dim=-2)
    return summed.masked_fill(~torch.tril(torch.ones(length, length, dtype=torch.bool)), -torch.inf)


def chunked_scan(x, a, b, c, chunk: int):
    """The SSD scan in chunks as the Mamba 2 paper's minimal code writes it: x [B, S, H, P], a [B, S, H],
    b and c [B, S, H, N]."""
    batch, seq, heads, _ = x.shape
    x, a, b, c = (t.reshape(batch, seq // chunk, chunk, *t.shape[2:]) for t in (x, a, b, c))
    a = a.permute(0, 3, 1, 2)  # [B, H, chunks, chunk]
    a_cumsum = torch.cumsum(a, dim=-1)
    decay = torch.exp(segment_sum(a))
    y_diag = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", c, b, decay, x)
    decay_states = torch.exp(a_cumsum[:, :, :, -1:] - a_cumsum)
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", b, decay_states, x)
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    decay_chunk = torch.exp(segment_sum(F.pad(a_cumsum[:, :, :, -1], (1, 0))))
    states = torch.einsum("bhzc,bchpn->bzhpn", decay_chunk, states)[:, :-1]
    y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", c, states, torch.exp(a_cumsum))
    return (y_diag + y_off).reshape(batch, seq, heads, -1)


class ScanLayer(nn.Module):
    """Mamba 2's mixer as minimal implementations write it: a projection, a short causal convolution
    over x, B and C, the chunked scan with a skip, a gated norm, a projection."""

    def __init__(self, dim: int, heads: int, state: int, chunk: int, kernel: int = 4):
        super().__init__()
        self.heads, self.state, self.chunk = heads, state, chunk
        self.in_proj = nn.Linear(dim, 2 * dim + 2 * heads * state + heads)
        channels = dim + 2 * heads * state
        self.conv = nn.Conv1d(channels, channels, kernel, groups=channels, padding=kernel - 1)
        self.a_log = nn.Parameter(torch.linspace(0.0, 1.0, heads))
        self.dt_bias = nn.Parameter(torch.zeros(heads))
        self.skip = nn.Parameter(torch.ones(heads))
        self.norm = nn.RMSNorm(dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, u):  # [B, S, D]
        batch, seq, dim = u.shape
        gate, xbc, dt = self.in_proj(u).split([dim, dim + 2 * self.heads * self.state, self.heads], dim=-1)
        xbc = F.silu(self.conv(xbc.transpose(1, 2))[..., :seq].transpose(1, 2))
        x, b, c = xbc.split([dim, self.heads * self.state, self.heads * self.state], dim=-1)
        x = x.view(batch, seq, self.heads, -1)
        b, c = (t.view(batch, seq, self.heads, self.state) for t in (b, c))
        dt = F.softplus(dt + self.dt_bias)
        y = chunked_scan(x * dt[..., None], -torch.exp(self.a_log) * dt, b, c, self.chunk)
        y = y + self.skip[:, None] * x
        return self.out_proj(self.norm(y.reshape(batch, seq, dim) * F.silu(gate)))


class ScanLM(nn.Module):
    """Plain PyTorch: an embedding, two Mamba 2 layers with residuals, an LM head."""

    def __init__(self, vocab: int = 96, dim: int = 32, heads: int = 4, state: int = 8, chunk: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(ScanLayer(dim, heads, state, chunk) for _ in range(2))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids, targets):
        x = self.embed(ids)
        for layer in self.layers:
            x = x + layer(x)
        logits = self.head(x)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten()), logits


def _assert_scans_on_heads(report, mixers: list[str]):
    """No sequence gathered: each mixer's scan reads its inputs on the rank's heads (all-to-alls), and
    its output goes back to the rank's block."""
    kinds = [call.kind for call in report.collectives]
    assert not report.replicated and not report.fallbacks, str(report)
    assert [line.split(":")[0] for line in report.off_sequence] == mixers, report.off_sequence
    assert "gather_seq" not in kinds and kinds.count("seq_to_heads") >= 2 * len(mixers), kinds


def scans_equal_to_eager(rank, world_size, seq):
    ids, labels = token_batch(seq=seq)
    ids, labels = ids % 96, labels.clamp(min=0) % 96
    (report,) = step_against_eager(rank, tiny_mamba2(), input_ids=ids, labels=labels, use_cache=False)
    _assert_scans_on_heads(report, ["backbone.layers.0.mixer", "backbone.layers.1.mixer"])
    assert report.convolutions == ["backbone.layers.0.mixer", "backbone.layers.1.mixer"], str(report)

    torch.manual_seed(0)
    (report,) = step_against_eager(rank, ScanLM(), ids, labels)
    _assert_scans_on_heads(report, ["layers.0", "layers.1"])


@pytest.mark.multirank
@pytest.mark.parametrize("world_size, seq", [
    pytest.param(2, 32, id="P2"),
    pytest.param(4, 32, id="P4", marks=pytest.mark.slow),
])
def test_chunked_scans_run_on_the_rank_heads_equal_to_eager(world_size, seq):
    """transformers' Mamba 2 (4 heads, chunks of 16) and a hand-written chunked-scan LM (the paper's
    minimal SSD, chunks of 8) at P = 2 and 4."""
    run_ranks(scans_equal_to_eager, world_size, seq)


def tiny_mamba(seed: int = 0):
    """transformers' Mamba (1): its selective scan as torch's generic ``associative_scan`` (odd and even
    positions sliced along the sequence, the combine vmapped), which it takes under torch.compile."""
    import transformers

    torch.manual_seed(seed)
    return transformers.MambaForCausalLM(transformers.MambaConfig(
        vocab_size=96, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4,
        use_associative_scan=True))


def mamba_scan_equal_to_eager(rank, world_size, seq):
    ids, labels = token_batch(seq=seq)
    ids, labels = ids % 96, labels.clamp(min=0) % 96
    (report,) = step_against_eager(rank, tiny_mamba(), input_ids=ids, labels=labels, use_cache=False)
    mixers = ["backbone.layers.0.mixer", "backbone.layers.1.mixer"]
    assert not report.replicated and not report.fallbacks, str(report)
    assert [line.split(":")[0] for line in report.off_sequence] == mixers, report.off_sequence
    assert report.convolutions == mixers, str(report)
    kinds = [call.kind for call in report.collectives]
    # the scan's state updates (x·dt·B and exp(A·dt), [B, I, S, N]) leave the sequence by all-to-all; what
    # is read whole instead is named in a note (C, [B, S, N], where its product keeps the state's rows)
    whole = [note for note in report.notes if "whole: it is gathered" in note]
    assert kinds.count("seq_to_heads") >= 2 * len(mixers) and kinds.count("gather_seq") == len(whole), str(report)


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_mamba_associative_scan_runs_off_the_sequence_equal_to_eager(world_size):
    run_ranks(mamba_scan_equal_to_eager, world_size, 30)


class VmappedCentering(nn.Module):
    """Attention, then each feature centred over the sequence under ``torch.vmap`` (over the features):
    the mean inside the vmapped body would need a collective across the ranks' blocks."""

    def __init__(self, dim: int = 32, heads: int = 4):
        super().__init__()
        self.qkv, self.out, self.heads = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), heads

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        h = self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d))
        centred = torch.vmap(lambda column: column - column.mean(1, keepdim=True), in_dims=2, out_dims=2)(h)
        return centred.square().mean(), centred


def test_a_vmapped_body_that_would_communicate_runs_on_whole_values(fake_group):
    """No collective is placed inside a vmap (it would run on batched tensors): its input enters whole,
    reported; the attention before it stays parallel."""
    from ulysses_compile.core.compat import vmap_decrement_nesting, vmap_increment_nesting

    fake_group(2)
    torch.manual_seed(0)
    (gm,) = rewritten_graphs(VmappedCentering(), (torch.randn(2, 32, 32),))
    report = gm.meta["ulysses_report"]
    assert "parallelized" in report.attention_sites[0].decision
    (fallback,) = report.fallbacks
    assert fallback.op == "_add_batch_dim" and "no collective runs inside vmap" in fallback.reason, fallback
    nodes = list(gm.graph.nodes)
    opened = [i for i, node in enumerate(nodes) if node.target is vmap_increment_nesting]
    closed = [i for i, node in enumerate(nodes) if node.target is vmap_decrement_nesting]
    inside = [node for node in nodes[opened[0]:closed[0]] if getattr(node.target, "__module__", "") ==
              "ulysses_compile.core.collectives"]
    assert len(opened) == len(closed) == 1 and inside == [], inside


def vmapped_equal_to_eager(rank, world_size):
    torch.manual_seed(0)
    (report,) = step_against_eager(rank, VmappedCentering(), torch.randn(2, 32, 32))
    kinds = [call.kind for call in report.collectives]
    assert "parallelized" in report.attention_sites[0].decision, str(report)
    assert kinds.count("seq_to_heads_qkv") == kinds.count("heads_to_seq") == 1, kinds
    assert [fallback.op for fallback in report.fallbacks] == ["_add_batch_dim"], str(report)


@pytest.mark.multirank
def test_a_vmapped_body_that_would_communicate_is_exact_at_two_ranks():
    run_ranks(vmapped_equal_to_eager, 2)


def tiny_bamba():
    """transformers' Bamba: a Mamba 2 layer (8 heads in 2 groups), then an attention layer."""
    import transformers

    torch.manual_seed(0)
    return transformers.BambaForCausalLM(transformers.BambaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2,
        mamba_d_state=8, mamba_chunk_size=16))


def hybrids_equal_to_eager(rank, world_size, seq):
    """transformers' Bamba, MiniMax (an attention layer, then lightning attention: a linear attention in
    chunks) and Qwen3.5 (two gated-DeltaNet layers: a triangular solve per chunk and head, a loop over the
    chunks writing into an output buffer, a gated norm over [B*S*H, D] rows), the last two as the zoo
    sweep shrinks them."""
    from zoo_sweep import tiny_model

    for name, build, attention, mixers in (
            ("bamba", tiny_bamba, 1, ["model.layers.0.mamba"]),
            ("minimax", lambda: tiny_model("minimax", "sdpa"), 1, ["model.layers.1.self_attn"]),
            ("qwen3_5", lambda: tiny_model("qwen3_5", "sdpa"), 0,
             ["model.layers.0.linear_attn", "model.layers.1.linear_attn"])):
        model = build()
        ids, labels = token_batch(seq=seq)
        ids, labels = ids % model.config.vocab_size, labels.clamp(min=0) % model.config.vocab_size
        reports = step_against_eager(rank, model, input_ids=ids, labels=labels, use_cache=False)
        sites = [site for report in reports for site in report.attention_sites]
        assert len(sites) == attention and all("parallelized" in site.decision for site in sites), name
        for report in reports:
            assert not report.fallbacks and not report.replicated, f"{name}: {report}"
            assert "gather_seq" not in [call.kind for call in report.collectives], f"{name}: {report}"
        moved = [line.split(":")[0] for report in reports for line in report.off_sequence]
        assert moved == mixers, f"{name}: {moved}"


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_hybrids_of_attention_and_scans_equal_to_eager(world_size):
    run_ranks(hybrids_equal_to_eager, world_size, 32)


def test_explain_shows_each_scan_on_the_rank_heads():
    """``explain`` of Mamba 2 at P = 4: nothing gathered, each mixer's scan on another dim with its
    all-to-alls in the collectives table."""
    from ulysses_compile import explain

    ids = torch.randint(0, 96, (1, 64))
    report = explain(tiny_mamba2(), input_ids=ids, labels=ids, use_cache=False, world_size=4, rank=1)
    text = str(report)
    assert not report.fallbacks and "gather_seq" not in text, text
    for layer in (0, 1):
        assert f"on the rank's part of another dim, whole along the sequence: backbone.layers.{layer}.mixer: " in text
        assert any(call.purpose == "seq_to_heads" and call.where == f"backbone.layers.{layer}.mixer"
                   for call in report.collectives), text


def test_the_scan_reads_the_rank_heads_of_each_input(fake_group):
    """One process at P = 4 (rank 1): the four inputs of each layer's scan (x and the time step's decay,
    [1, S, H, P] and [1, S, H], B and C) leave the rank's block of 8 positions for its one head of four,
    and the scan's output comes back: five all-to-alls a layer, the fewest its values allow."""
    fake_group(4, 1)
    torch.manual_seed(0)
    ids = torch.randint(0, 96, (1, 32))
    (gm,) = rewritten_graphs(ScanLM(), (ids, ids))
    _assert_scans_on_heads(gm.meta["ulysses_report"], ["layers.0", "layers.1"])
    moves = [(tuple(node.args[0].meta["example_value"].shape), node.kwargs["seq_dim"], node.kwargs["head_dim"])
             for node in gm.graph.nodes if getattr(node.target, "__name__", "") == "seq_to_heads"]
    to_heads = [(1, 8, 4, 8), (1, 8, 4, 8), (1, 8, 4, 8), (1, 8, 4)]
    assert sorted(moves) == sorted(2 * ([(shape, 1, 2) for shape in to_heads] + [((1, 32, 1, 8), 2, 1)])), moves


def test_gated_delta_net_rows_go_back_to_the_sequence_by_one_all_to_all(fake_group):
    """One process at P = 4 (rank 1), transformers' Qwen3.5 (two gated-DeltaNet layers of 4 value heads):
    q, k, v, beta and the decay go to the rank's head, and the gated norm's [B*S*H, D] rows, held over the
    heads after the scan, come back to the rank's positions by one all-to-all of the same dim viewed as
    [B, S, H, D] (no sequence gathered)."""
    from zoo_sweep import tiny_model

    fake_group(4, 1)
    ids = torch.randint(0, 64, (1, 32))
    (gm,) = rewritten_graphs(tiny_model("qwen3_5", "sdpa"), (), {"input_ids": ids, "labels": ids, "use_cache": False})
    _assert_scans_on_heads(gm.meta["ulysses_report"], ["model.layers.0.linear_attn", "model.layers.1.linear_attn"])
    moves = [node for node in gm.graph.nodes if getattr(node.target, "__name__", "") == "seq_to_heads"]
    to_heads = [node for node in moves if node.args[0].op != "call_method" or node.args[0].target != "unflatten"]
    back = [node for node in moves if node not in to_heads]
    assert [(node.kwargs["seq_dim"], node.kwargs["head_dim"], node.kwargs["seq_len"]) for node in to_heads] \
        == [(2, 1, 32)] * 10, to_heads
    assert [(node.args[0].args[1:], node.kwargs["seq_dim"], node.kwargs["head_dim"], node.kwargs["seq_len"],
             [user.target for user in node.users]) for node in back] \
        == [((0, (1, 32, -1, 1)), 2, 1, 4, ["flatten"])] * 2, back
