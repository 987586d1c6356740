"""Slices of a sharded sequence (``x[:, 1:]``, ``logits[:, :-1]``): each takes the balanced blocks of its
own length, the rows crossing a rank boundary moved by one all-to-all (``reblock_seq``), never the whole
sequence gathered. Written as plain PyTorch does it: nanochat's smear (each position mixed with the one
before it) and a causal LM loss shifted by hand as minGPT writes it."""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from graphs import calls, rewritten_graphs
from multirank import compare_model, run_ranks
from test_rules import build, decide, empty
from ulysses_compile.core.collectives import (
    gather_blocks,
    gather_seq,
    heads_to_seq,
    reblock_seq,
    reduce_partial,
    seq_to_heads_qkv,
    shift_seq,
)
from ulysses_compile.core.sharding import PARTIAL, Shard

VOCAB, DIM, HEADS = 64, 32, 4


class _CausalLM(nn.Module):
    """An embedding, one causal SDPA attention (as a residual) and an LM head, around each model's own ops."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def attend(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        return x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)


class SmearedShiftedLM(_CausalLM):
    def __init__(self):
        super().__init__()
        self.smear_gate = nn.Linear(DIM, 1)
        self.mix = nn.Linear(DIM, DIM)

    def forward(self, idx):
        x = self.embed(idx)
        gate = torch.sigmoid(self.smear_gate(x[:, 1:]))
        x = x[:, 1:] + gate * x[:, :-1]  # nanochat's smear: each position mixed with the one before it
        x = x + self.mix(x)
        x = self.attend(x)
        logits = self.head(x)
        # minGPT's loss, shifted by hand: position t predicts the token after it (t + 2 of idx here)
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), idx[:, 2:].reshape(-1))


class TokenShiftLM(_CausalLM):
    """x-transformers' ``shift_tokens``: channel chunks padded along the sequence by (k, -k) (one token
    back, and one forward), as RWKV's ``ZeroPad2d((0, 0, 1, -1))`` (one chunk's channels shifted as
    well); a roll of the positions (``x.roll``, the method); a shift spelled ``cat([start_token, y[:, :-1]])`` of a
    shifted ``y``; a shift back spelled ``cat([x[:, 1:], end_token])``."""

    def __init__(self):
        super().__init__()
        self.start = nn.Parameter(torch.randn(1, 1, DIM))
        self.end = nn.Parameter(torch.randn(1, 1, DIM))

    def forward(self, idx):
        x = self.embed(idx)
        shifted = F.pad(x, (0, 0, 1, -1))
        x = x + torch.cat([self.start.expand(x.shape[0], 1, DIM), shifted[:, :-1]], dim=1)  # a learned start token
        back, forward, rest = x.split([DIM // 4, DIM // 4, DIM // 2], dim=-1)
        back = F.pad(back, (1, -1, 1, -1))  # its channels shifted too, on each block
        x = torch.cat([back, F.pad(forward, (0, 0, -1, 1), value=0.5), rest], dim=-1)
        x = x + 0.1 * x.roll(2, dims=1)
        x = x + 0.1 * torch.cat([x[:, 1:], self.end.expand(x.shape[0], 1, DIM)], dim=1)  # a learned end token
        x = self.attend(x)
        return F.cross_entropy(self.head(x).reshape(-1, VOCAB), idx.reshape(-1))


class FirstAndLastRows(_CausalLM):
    """Rows inside one rank's block: the first token repeated in front of the shifted sequence
    (``cat([x[:, :1], x[:, :-1]])``), and the last position's logits (``logits[:, -1:]``, as
    transformers' ``logits_to_keep=1`` slices them) in the loss."""

    def forward(self, idx):
        x = self.embed(idx)
        x = x + torch.cat([x[:, :1], x[:, :-1]], dim=1)
        x = self.attend(x)
        logits = self.head(x)
        last = logits[:, -1:].reshape(-1, VOCAB)
        return F.cross_entropy(logits.reshape(-1, VOCAB), idx.reshape(-1)) + F.cross_entropy(last, idx[:, 0])


def _ids(seq: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(1))


def test_a_slice_of_the_sharded_sequence_stays_sharded_unless_strided():
    node, (x,) = build(operator.getitem, empty(2, 8, 4), (slice(None), slice(1, None)))
    decision = decide(node, {x: Shard(1)})
    assert decision.output == Shard(1) and decision.inputs == {x: Shard(1)} and decision.localize is not None
    node, (x,) = build(operator.getitem, empty(2, 8, 4), (slice(None), slice(None, None, 2)))
    assert decide(node, {x: Shard(1)}) is None
    node, (x,) = build(operator.getitem, empty(2, 8, 4), (slice(None), slice(None, 1)))
    decision = decide(node, {x: Shard(1)})  # inside rank 0's block: its part of a sum, zeros elsewhere
    assert decision.output == PARTIAL and decision.localize is not None


def _parallel_with_no_gather(fake_group, model_class):
    """``model_class`` rewritten at P = 4 (S = 35): its one SDPA site turned to heads and back by one
    all-to-all each way, no fallback and nothing gathered; the graph, for each test's own counts."""
    fake_group(4)
    torch.manual_seed(0)
    (gm,) = rewritten_graphs(model_class(), (_ids(35),))
    report = gm.meta["ulysses_report"]
    assert report.fallbacks == [] and [site.spelling for site in report.attention_sites] == [
        "scaled_dot_product_attention"]
    assert calls(gm, gather_seq) == [] and calls(gm, gather_blocks) == []
    assert len(calls(gm, seq_to_heads_qkv)) == len(calls(gm, heads_to_seq)) == 1
    return gm


def test_the_smear_and_the_shifted_loss_run_sharded_with_no_gather(fake_group):
    gm = _parallel_with_no_gather(fake_group, SmearedShiftedLM)
    assert len(calls(gm, reblock_seq)) == 4  # x[:, 1:] read twice, x[:, :-1], logits[:, :-1]: rows move


def test_token_shifts_move_rows_between_neighbours_with_no_gather(fake_group):
    gm = _parallel_with_no_gather(fake_group, TokenShiftLM)
    assert [node.kwargs["shift"] for node in calls(gm, shift_seq)] == [1, 1, 1, -1, 2, -1]
    assert calls(gm, reblock_seq) == []  # the cat's slice x[:, :-1] is not computed


def test_a_pad_or_roll_of_the_sequence_shifts_it_unless_it_grows_or_passes_a_block():
    node, (x,) = build(F.pad, empty(2, 8, 4), (0, 0, 1, -1))
    decision = decide(node, {x: Shard(1)})
    assert decision.output == Shard(1) and decision.localize is not None
    node, (x,) = build(F.pad, empty(2, 8, 4), (1, 1))  # the channels only: each block padded
    assert decide(node, {x: Shard(1)}).localize is None
    node, (x,) = build(F.pad, empty(2, 8, 4), (0, 0, 1, 0))  # grows the sequence
    assert decide(node, {x: Shard(1)}) is None
    node, (x,) = build(F.pad, empty(2, 8, 4), (0, 0, 5, -5))  # more than a block of 4
    assert decide(node, {x: Shard(1)}) is None
    node, (x,) = build(torch.roll, empty(2, 8, 4), -1, 1)
    assert decide(node, {x: Shard(1)}).localize is not None
    node, (x,) = build(torch.roll, empty(2, 8, 4), 3, -1)  # along the channels: each block rolled
    assert decide(node, {x: Shard(1)}).localize is None


def test_rows_inside_one_block_are_a_partial_sum_not_a_gather(fake_group):
    gm = _parallel_with_no_gather(fake_group, FirstAndLastRows)
    assert [node.kwargs["shift"] for node in calls(gm, shift_seq)] == [1]
    assert len(calls(gm, reduce_partial)) >= 2  # x[:, :1] and logits[:, -1:] summed over the ranks


class SlicedWhereShardingStarts(_CausalLM):
    """Slices where sharding starts or a partial value meets them: inputs cut from a replicated batch
    (``batch[:, :-1]``), a running sum's tail, and logits sliced after a graph break (a value that
    arrives as the rank's block)."""

    def forward(self, batch):
        idx, targets = batch[:, :-1], batch[:, 1:]
        x = self.embed(idx)
        x = x + x.cumsum(1)[:, :1].expand_as(x) * 0.01
        x = self.attend(x)
        logits = self.head(x)
        torch._dynamo.graph_break()
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), targets[:, :-1].reshape(-1))


def test_slices_where_sharding_starts_compile_and_run_sharded(fake_group):
    fake_group(2)
    torch.manual_seed(0)
    graphs = rewritten_graphs(SlicedWhereShardingStarts(), (_ids(33),))
    reports = [gm.meta["ulysses_report"] for gm in graphs]
    assert [len(report.attention_sites) for report in reports] == [1, 0]
    assert len(calls(graphs[0], seq_to_heads_qkv)) == len(calls(graphs[0], heads_to_seq)) == 1


def equal_to_eager(rank, world_size, seq, model_class):
    torch.manual_seed(0)
    model = model_class()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="ulysses", options={"compiler": "aot_eager"})
    loss = compiled(_ids(seq))
    loss.backward()
    want = reference(_ids(seq))
    want.backward()
    compare_model(rank, model, reference, {"loss": (loss, want)})


@pytest.mark.multirank
@pytest.mark.parametrize("world_size, seq", [(2, 33), (2, 34), (4, 35)], ids=["P2 uneven", "P2 even", "P4 uneven"])
def test_the_smear_and_the_shifted_loss_equal_to_eager(world_size, seq):
    run_ranks(equal_to_eager, world_size, seq, SmearedShiftedLM)


@pytest.mark.multirank
@pytest.mark.parametrize("world_size, seq", [(2, 33), (3, 34), (4, 35)], ids=["P2 uneven", "P3 uneven", "P4 uneven"])
def test_token_shifts_equal_to_eager(world_size, seq):
    run_ranks(equal_to_eager, world_size, seq, TokenShiftLM)


@pytest.mark.multirank
@pytest.mark.parametrize("world_size, seq", [(2, 33), (4, 35)], ids=["P2 uneven", "P4 uneven"])
def test_rows_inside_one_block_equal_to_eager(world_size, seq):
    run_ranks(equal_to_eager, world_size, seq, FirstAndLastRows)


def rows_read_around_a_write_equal_to_eager(rank, world_size):
    from test_multirank import probes_equal_to_eager

    probes_equal_to_eager(rank, world_size, (15,), names=("rows_read_around_a_write", "position_read_around_a_write"))


@pytest.mark.multirank
def test_rows_read_around_a_write_of_their_source_equal_to_eager():
    """The rank holding the rows reads a view of the written source, the others zeros: every rank
    completes them with the same all-reduces in the same order (one per reader). The probes have 2 heads."""
    run_ranks(rows_read_around_a_write_equal_to_eager, 2)


@pytest.mark.multirank
def test_slices_where_sharding_starts_equal_to_eager_at_two_ranks():
    run_ranks(equal_to_eager, 2, 33, SlicedWhereShardingStarts)
