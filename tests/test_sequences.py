"""Any sequence length, sequence-first layouts, graph breaks, a data x sequence mesh, and ranks that
disagree: structure in one process, numerics on real gloo ranks against eager."""

from __future__ import annotations

import copy

import pytest
import torch

from attention_forms import outputs_of
from models import model_zoo, token_batch, tiny_llama, zoo_inputs
from multirank import compare_model, run_ranks
from sequence_models import break_around, graph_break_gpt, sequence_first
from graphs import calls, rewritten_graphs
from ulysses_compile import RankMismatchError
from ulysses_compile.core.collectives import (average_grad, heads_to_seq, reblock_seq, scatter_seq, seq_to_heads,
                                              seq_to_heads_qkv)


def test_sequence_first_layout_is_split_on_dim_zero(fake_group):
    fake_group(4)
    model, args, kwargs = sequence_first()
    (gm,) = rewritten_graphs(model, args, kwargs)
    scatters = {n.args[0].name: (n.kwargs["dim"], tuple(n.meta["val"].shape)) for n in calls(gm, scatter_seq)}
    assert scatters["l_ids_"] == (0, (8, 2))
    assert len(calls(gm, seq_to_heads_qkv)) == 2 and calls(gm, seq_to_heads) == [] and len(calls(gm, heads_to_seq)) == 2
    assert gm.meta["ulysses_report"].fallbacks == []


def test_graph_breaks_pass_the_ranks_blocks_on(fake_group):
    """Each graph leaves its hidden states as the rank's block, the next graph takes that block (no
    gather), and the graph after the last break (the LM head and loss, no attention) runs on it too."""
    fake_group(2)
    model, args, kwargs = graph_break_gpt()
    graphs = rewritten_graphs(model, args, kwargs)
    reports = [gm.meta["ulysses_report"] for gm in graphs]
    assert [len(report.attention_sites) for report in reports] == [1, 1, 0]
    assert [report.replicated for report in reports] == ["", "", ""]
    for report in reports[:2]:  # each block's attention turned to heads and back by its all-to-alls
        kinds = [c.kind for c in report.collectives]
        assert [kinds.count(kind) for kind in ("seq_to_heads_qkv", "heads_to_seq")] == [1, 1], kinds
    assert [report.gathered_outputs for report in reports] == [[], [], []]
    assert [list(report.sharded_outputs) for report in reports] == [[0], [0], [0]]  # hidden, hidden, logits
    assert all(f.reason.endswith("(nothing gathered)") for report in reports for f in report.fallbacks)
    scattered = [[node.args[0].name for node in calls(gm, scatter_seq)] for gm in graphs[1:]]
    assert scattered == [["l_x_"], ["l_x_", "view_1"]], scattered  # the hidden states' own blocks; the targets
    kinds = [c.kind for c in reports[2].collectives]  # the loss' sum and count; the weights' gradients summed
    assert kinds.count("reduce_partial") == 2 and set(kinds) == {"reduce_partial", "sync_grad"}, kinds


def test_data_parallel_mesh_averages_every_trainable_parameter(fake_group):
    from torch.distributed.device_mesh import init_device_mesh

    fake_group(4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
    model = tiny_llama(layers=1)
    ids, labels = token_batch(seq=32)
    (gm,) = rewritten_graphs(model, (), {"input_ids": ids, "labels": labels, "use_cache": False}, mesh=mesh)
    averaged = {n.args[0].name for n in calls(gm, average_grad)}
    assert len(averaged) == len(list(model.parameters()))
    assert len(calls(gm, seq_to_heads_qkv)) == 1 and calls(gm, seq_to_heads) == []


def _equal_to_eager(rank, model, args, kwargs, name):
    reference = copy.deepcopy(model)
    torch.compiler.reset()
    got = outputs_of(torch.compile(model, backend="ulysses", options={"compiler": "aot_eager"})(*args, **kwargs))
    got["loss"].backward()
    want = outputs_of(reference(*args, **kwargs))
    want["loss"].backward()
    compare_model(rank, model, reference, {f"{name} {key}": (got[key], want[key]) for key in got})


class RowsPerPosition(torch.nn.Module):
    """Attention over S positions, then each position made into 2 rows of a second attention's sequence
    (BLT's patches: ``[B, S, 2D]`` reshaped to ``[B, 2S, D]``): at S = 25 over 4 ranks the positions'
    blocks (7, 6, 6, 6) are rows 14, 12, 12, 12, where the second attention's 50 rows split 13, 13, 12, 12."""

    def __init__(self, dim: int = 16, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.widen = torch.nn.Linear(dim, 2 * dim)
        self.rows_qkv = torch.nn.Linear(dim, 3 * dim)

    def attend(self, x, qkv):
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in qkv(x).chunk(3, dim=-1))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)

    def forward(self, x):
        b, s, d = x.shape
        x = x + self.attend(x, self.qkv)
        return self.attend(self.widen(x).reshape(b, 2 * s, d), self.rows_qkv)


def test_rows_of_another_block_size_move_between_neighbours_and_both_attentions_stay_parallel(fake_group):
    """The structure behind the "two rows per position" case (rank 0 of 4): both attentions parallelized
    (q, k and v to heads in one all-to-all each, the output back), and q, k and v of the second regrouped
    from the positions' blocks (14 rows here) into the attention's (13) between neighbours, not gathered."""
    fake_group(4, 0)
    torch.manual_seed(0)
    (gm,) = rewritten_graphs(RowsPerPosition(), (torch.randn(2, 25, 16),))
    report = gm.meta["ulysses_report"]
    kinds = [call.kind for call in report.collectives]
    assert len(report.attention_sites) == 2 and all("parallelized" in site.decision for site in report.attention_sites)
    assert kinds.count("seq_to_heads_qkv") == kinds.count("heads_to_seq") == 2, kinds
    assert kinds.count("reblock_seq") == 3 and "gather_seq" not in kinds and not report.fallbacks, kinds
    held = [node.kwargs["held"][0] for node in gm.graph.nodes if node.target is reblock_seq]
    assert held == [(0, 14)] * 3, held


def _case(name: str) -> tuple:
    """(model, args, kwargs) of one case at four ranks: S = 30 splits 8, 8, 7, 7; S = 2 is shorter than
    the ranks (replicated); cumsum positions, first-token pooling, a sequence-first layout, graph breaks."""
    if name.startswith("llama"):
        ids, labels = token_batch(seq=int(name.split("S=")[1]))
        return tiny_llama(), (), {"input_ids": ids, "labels": labels, "use_cache": False}
    if name in ("roberta_padding", "bert_classifier"):
        factory, kind = model_zoo()[name]
        return factory(), (), zoo_inputs(kind, seq=30)
    if name == "two rows per position":
        torch.manual_seed(0)
        return RowsPerPosition(), (torch.randn(2, 25, 16),), {}
    return (sequence_first if name == "sequence_first" else graph_break_gpt)(seq=30)


CASES = ["llama S=30", "llama S=2", "roberta_padding", "bert_classifier", "sequence_first", "graph_breaks",
         "two rows per position"]


def case_equal_to_eager(rank, world_size, name):
    _equal_to_eager(rank, *_case(name), name)


@pytest.mark.multirank
@pytest.mark.parametrize("name", CASES)
def test_lengths_layouts_and_graph_breaks_equal_to_eager_at_four_ranks(name):
    run_ranks(case_equal_to_eager, 4, name)


def data_times_sequence_mesh(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
    replica = mesh.get_local_rank("dp")
    model = tiny_llama(layers=1)
    reference = copy.deepcopy(model)
    batches = [token_batch(seq=32, seed=seed) for seed in (1, 2)]  # one batch per replica
    ids, labels = batches[replica]
    compiled = torch.compile(model, backend="ulysses", options={"compiler": "aot_eager", "mesh": mesh})
    loss = compiled(input_ids=ids, labels=labels, use_cache=False).loss
    loss.backward()
    eager_losses = [reference(input_ids=i, labels=l, use_cache=False).loss for i, l in batches]
    (sum(eager_losses) / len(eager_losses)).backward()  # DDP: the replicas' gradients averaged
    compare_model(rank, model, reference, {"replica loss": (loss, eager_losses[replica])})


@pytest.mark.multirank
def test_data_times_sequence_mesh_averages_the_replicas():
    run_ranks(data_times_sequence_mesh, 4)



def disagreeing_ranks(rank, world_size):
    ids, labels = token_batch(seq=32 if rank == 0 else 48)
    compiled = torch.compile(tiny_llama(layers=1), backend="ulysses", options={"compiler": "aot_eager"})
    with pytest.raises(RankMismatchError) as raised:
        compiled(input_ids=ids, labels=labels, use_cache=False)
    message = str(raised.value)
    assert f"rank {rank}: the sequence-parallel ranks compiled different programs" in message
    assert "input_ids: rank 0 (2, 32) int64, rank 1 (2, 48) int64" in message


@pytest.mark.multirank
def test_ranks_fed_different_shapes_get_an_error_not_a_hang():
    run_ranks(disagreeing_ranks, 2)


def ranks_fed_different_values(rank, world_size):
    """Ranks with batches of one shape but other values, as a DistributedSampler hands them out: the
    first call refuses to run; so does a later mixed call on CPU ranks, the last of a loop included (on
    a GPU it would run and the next call raise), on every rank; with the check turned off, nothing is
    raised."""
    own, shared = token_batch(seq=32, seed=1 + rank), token_batch(seq=32, seed=9)
    compiled = torch.compile(tiny_llama(layers=1), backend="ulysses", options={"compiler": "aot_eager"})
    with pytest.raises(RankMismatchError, match=rf"rank {rank}: the sequence-parallel ranks passed different "
                                                r"values in input_ids, labels to compiled graph .*its first call"):
        compiled(input_ids=own[0], labels=own[1], use_cache=False)
    torch.compiler.reset()
    compiled = torch.compile(tiny_llama(layers=1), backend="ulysses", options={"compiler": "aot_eager"})
    for ids, labels in (shared, shared):
        compiled(input_ids=ids, labels=labels, use_cache=False).loss.backward()
    with pytest.raises(RankMismatchError, match=r"different values in labels to .*call 3, before it ran"):
        compiled(input_ids=shared[0], labels=own[1], use_cache=False)  # labels differ in the last call
    torch.compiler.reset()
    unchecked = torch.compile(tiny_llama(layers=1), backend="ulysses",
                              options={"compiler": "aot_eager", "check_inputs": False})
    unchecked(input_ids=own[0], labels=own[1], use_cache=False)


@pytest.mark.multirank
def test_ranks_fed_different_values_get_an_error_on_every_rank():
    run_ranks(ranks_fed_different_values, 2)


def _compiled_counting_graphs(model, **compile_kwargs):
    """The model compiled with the ulysses backend (eager inner compiler), and the list of rewritten graphs."""
    from ulysses_compile.backend import ulysses

    graphs = []

    def capture(gm, example_inputs):
        compiled = ulysses(gm, example_inputs, options={"compiler": "eager"})
        graphs.append(gm)
        return compiled

    return torch.compile(model, backend=capture, **compile_kwargs), graphs


def test_changing_lengths_share_a_symbolic_graph_per_remainder_class(fake_group):
    from ulysses_compile.core.sharding import block_sizes

    fake_group(4, rank=3)
    compiled, graphs = _compiled_counting_graphs(tiny_llama(layers=1))
    counts = []
    for seq in (32, 48, 64, 40, 30, 38, 6, 3):
        ids, labels = token_batch(seq=seq)
        compiled(input_ids=ids, labels=labels, use_cache=False)
        counts.append(len(graphs))
    # 32 static; one symbolic graph for the multiples of 4 and one for remainder 2 (each at least 2P);
    # 6 (< 2P) is compiled for its length; 3 (< P) runs replicated.
    assert counts == [1, 2, 2, 2, 3, 3, 4, 5]
    assert [bool(gm.meta["ulysses_report"].replicated) for gm in graphs] == [False] * 4 + [True]
    for gm, lengths in ((graphs[1], (48, 64, 40, 1000)), (graphs[2], (30, 38, 1002))):
        ids_input = next(n for n in gm.graph.find_nodes(op="placeholder") if "input_ids" in n.name)
        symbol = ids_input.meta["example_value"].shape[1].node.expr
        (to_heads,) = calls(gm, seq_to_heads_qkv)  # q, k and v in one all-to-all
        assert calls(gm, seq_to_heads) == []
        assert all(to_heads.kwargs[length].meta["val"].node.expr == symbol for length in ("seq_len", "kv_seq_len"))
        sent = (to_heads.args[0], to_heads.kwargs["key"], to_heads.kwargs["value"])
        assert isinstance(to_heads.meta["val"], tuple) and len(to_heads.meta["val"]) == 3
        for before, after in zip(sent, to_heads.meta["val"]):
            for seq in lengths:  # rank 3's [B, H, S/P, D] before the all-to-all
                assert before.meta["val"].shape[2].node.expr.subs(symbol, seq) == block_sizes(seq, 4)[3]
                # after it: the whole sequence, as the sum of every rank's block
                assert after.shape[2].node.expr.subs(symbol, seq) == seq


def dynamic_lengths_equal_to_eager(rank, world_size):
    from torch._dynamo.utils import counters

    counters.clear()
    model = tiny_llama(layers=1)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="ulysses", options={"compiler": "aot_eager"}, fullgraph=True)
    for seq in (32, 48, 40, 31, 45):
        model.zero_grad()
        reference.zero_grad()
        ids, labels = token_batch(seq=seq)
        got = compiled(input_ids=ids, labels=labels, use_cache=False)
        got.loss.backward()
        want = reference(input_ids=ids, labels=labels, use_cache=False)
        want.loss.backward()
        compare_model(rank, model, reference, {f"S={seq} loss": (got.loss, want.loss),
                                               f"S={seq} logits": (got.logits, want.logits)})
    assert counters["stats"]["unique_graphs"] == 3  # 32; the even lengths; the odd ones


@pytest.mark.multirank
def test_changing_lengths_compile_at_most_once_per_class_and_equal_eager():
    run_ranks(dynamic_lengths_equal_to_eager, 2)


def breaks_around_the_head(rank, world_size):
    """Logits the tiled loss would compute when read cross a graph break computed, as the rank's block:
    equal to eager. A graph that writes in place into the block the graph before it left gets an
    ``UnsupportedError`` with the fix on every rank, where it would lose the write's gradient."""
    from ulysses_compile import UnsupportedError

    _equal_to_eager(rank, *break_around("after_loss", seq=31), "logits across a break")
    model, args, kwargs = break_around("write")
    torch.compiler.reset()
    with pytest.raises(Exception, match="writes in place into a sequence-sharded value") as raised:
        torch.compile(model, backend="ulysses", options={"compiler": "aot_eager"})(*args, **kwargs)
    assert isinstance(raised.value, UnsupportedError) or "UnsupportedError" in str(raised.value)


@pytest.mark.multirank
def test_values_crossing_breaks_around_the_head():
    run_ranks(breaks_around_the_head, 2)
