"""One program for every rank: where the ranks' blocks are of one size, the graph after the passes and
Inductor's output code are the same on every rank (the rank is read when the graph runs, and a mesh's
groups are passed by one name), so AOTAutograd merges equal nodes and Inductor's cache filled by one
rank serves the others. Loss and every gradient still equal eager's."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from graphs import reporting_backend
from models import tiny_llama, token_batch
from multirank import compare_model, run_ranks
from ulysses_compile.backend import inner_compile, rewrite
from ulysses_compile.core.collectives import gather_objects
from ulysses_compile.core.compat import _resolve_process_group, dynamo_counters, run_and_get_code
from ulysses_compile.core.options import Options

pytestmark = pytest.mark.multirank


def _llama_step(compiled, ids, labels):
    def step():
        loss = compiled(input_ids=ids, labels=labels, use_cache=False).loss
        loss.backward()
        return loss

    return step


def _dumped(folder: Path) -> dict[str, str]:
    """Every compile's graph code before and after each pass, and its report, as written by dump_dir."""
    return {str(path.relative_to(folder)): path.read_text() for path in sorted(folder.rglob("*")) if path.is_file()}


def one_program(rank, world_size, dump_dir, mesh_shape, ring=None):
    """A Llama (4 query heads, 2 KV heads: at P = 4 each KV head serves two ranks) compiled with Inductor
    on every rank: the dumped graphs and Inductor's forward and backward code are compared across the
    ranks, loss and gradients against eager. ``ring``: a ring of that many ranks, Ulysses over the rest."""
    model = tiny_llama(heads=4, kv_heads=2)
    reference = copy.deepcopy(model)
    ids, labels = token_batch(seq=32)
    options = {"compiler": "inductor", "dump_dir": dump_dir, "ring": ring}
    if mesh_shape is not None:
        options["mesh"] = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "sp"))
    compiled = torch.compile(model, backend="ulysses", options=options)
    loss, codes = run_and_get_code(_llama_step(compiled, ids, labels))
    want = reference(input_ids=ids, labels=labels, use_cache=False)
    want.loss.backward()
    compare_model(rank, model, reference, {"loss": (loss, want.loss)})

    dumped = _dumped(Path(dump_dir) / f"rank{rank}")
    (final,) = [code for name, code in dumped.items() if name.endswith("_recompute_inserted_nodes.py")]
    groups = 1 if ring is None else 2  # and the rank's place in its Ulysses group
    assert final.count("rank_of_group(") == groups, "expected one graph reading its rank once in each group"
    # per layer: q, k, v to heads in one all-to-all, or at P = 4 (past the 2 KV heads) q in one and k and
    # v each gathered for the rank's KV head; the output back in one
    ulysses = world_size // (mesh_shape or (1,))[0] // (ring or 1)
    to_heads = {"seq_to_heads_qkv": 1} if ulysses == 2 else {"seq_to_heads": 1, "gather_kv_heads": 2}
    for call, per_layer in {**to_heads, "heads_to_seq": 1, "ring_attention": int(ring is not None)}.items():
        assert len(re.findall(rf"_{call}\(", final)) == 2 * per_layer, call
    assert not re.search(r"rank = \d", final)
    assert len(codes) == 2, "expected Inductor's forward and backward"
    every = gather_objects((dumped, codes), dist.group.WORLD)
    for other, (other_dumped, other_codes) in enumerate(every):
        assert other_dumped == dumped, f"rank {other}'s graphs differ from rank {rank}'s: " + ", ".join(
            name for name in dumped if other_dumped.get(name) != dumped[name])
        assert other_codes == codes, f"rank {other}'s Inductor code differs from rank {rank}'s"


@pytest.mark.parametrize("world_size,mesh_shape,ring", [
    pytest.param(2, None, None, id="P2"), pytest.param(4, None, None, id="P4"),
    pytest.param(4, (2, 2), None, id="dp2-sp2", marks=pytest.mark.slow),  # the suite's time; a 2 x 2 ring mesh
    pytest.param(4, None, 2, id="P4-ring2")])                              # is in test_ring's default tier
def test_every_rank_compiles_one_program(world_size, mesh_shape, ring, tmp_path):
    run_ranks(one_program, world_size, str(tmp_path), mesh_shape, ring)


def _compile_on_rank(rank: int, world_size: int, init) -> dict[str, int]:
    """One rank's program, compiled with Inductor on a fake process group of ``world_size``; the
    cache counters it moved."""
    init(world_size, rank)
    torch.compiler.reset()
    dynamo_counters.clear()

    def backend(gm, example_inputs):
        _, report = rewrite(gm, example_inputs, Options.parse({}), dist.group.WORLD)
        assert report.attention_sites and not report.rank_specific, report
        return inner_compile(gm, example_inputs, "inductor")

    ids, labels = token_batch(seq=32)
    _llama_step(torch.compile(tiny_llama(heads=4, kv_heads=2), backend=backend), ids, labels)()
    return {key: value for key, value in dynamo_counters["inductor"].items() if key.startswith("fxgraph_cache")}


@pytest.mark.slow  # the suite's time (50-85 s)
def test_the_inductor_cache_one_rank_fills_serves_the_others(fake_group, tmp_path, monkeypatch):
    """Ranks compiled one after another in one process, each on a fake group: rank 0 fills a fresh cache
    (a miss per graph, forward and backward), ranks 1 to 3 hit it and miss nothing."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    with torch._inductor.config.patch(fx_graph_cache=True):
        first = _compile_on_rank(0, 4, fake_group)
        assert first.get("fxgraph_cache_miss", 0) == 2 and not first.get("fxgraph_cache_hit"), first
        for rank in (1, 2, 3):
            counts = _compile_on_rank(rank, 4, fake_group)
            assert counts.get("fxgraph_cache_hit", 0) == 2 and not counts.get("fxgraph_cache_miss"), (rank, counts)


def test_uneven_blocks_keep_the_rank(fake_group):
    """A sequence P does not divide: the ranks' blocks differ in size, so their code does; the report says
    which nodes hold the rank's number."""
    fake_group(4, 1)
    ids, labels = token_batch(seq=30)
    reports = []

    def backend(gm, example_inputs):
        _, report = rewrite(gm, example_inputs, Options.parse({"compiler": "eager"}), dist.group.WORLD)
        reports.append(report)
        return gm.forward

    torch.compile(tiny_llama(heads=4, kv_heads=2), backend=backend)(input_ids=ids, labels=labels, use_cache=False)
    (report,) = reports
    assert report.attention_sites and report.rank_specific, report.rank_specific
    assert "rank-specific code" in str(report)


def test_a_mesh_names_each_dim_alike_on_every_rank():
    """The names a mesh's groups are passed by: one per dim, the same on every rank, each resolving to
    the rank's own group."""
    run_ranks(mesh_names, 4)


def mesh_names(rank, world_size):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
    options = Options.parse({"mesh": mesh})
    names = (options.group_name(), options.data_parallel_group_name())
    assert names[0] != names[1]
    assert all(name.startswith("ulysses_") for name in names), names
    assert len({tuple(every) for every in gather_objects(names, dist.group.WORLD)}) == 1
    assert _resolve_process_group(names[0]).group_name == mesh.get_group("sp").group_name
    assert _resolve_process_group(names[1]).group_name == mesh.get_group("dp").group_name
    assert Options.parse({"mesh": mesh}).group_name() == names[0]  # registered once


class TwoSlices(torch.nn.Module):
    """An attention, then two slices of its output's sequence (31 and 30 rows of 32): at P = 4 their
    exchanges of rows between neighbours are equal ops on some ranks and not on others."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(64, 32)
        self.qkv = torch.nn.Linear(32, 96, bias=False)
        self.out = torch.nn.Linear(32, 32, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, 4, 8).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = self.out(y.transpose(1, 2).reshape(batch, seq, 32))
        return (h[:, :-1] ** 2).mean() + (h[:, :-2] ** 2).mean()


def two_slices_equal_to_eager(rank, world_size):
    model = TwoSlices()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    reports = []
    loss = torch.compile(model, backend=reporting_backend(reports))(ids)
    loss.backward()
    (report,) = reports
    assert len(report.attention_sites) == 1 and report.rank_specific, str(report)
    kinds = [c.kind for c in report.collectives]
    assert [kinds.count(kind) for kind in ("seq_to_heads_qkv", "heads_to_seq", "reblock_seq")] == [1, 1, 2], kinds
    want = reference(ids)
    want.backward()
    compare_model(rank, model, reference, {"loss": (loss, want)})


def test_sequence_slices_whose_exchanges_match_on_some_ranks_only_merge_nothing():
    """Each rank's exchange is shaped by its number, so AOTAutograd's CSE, which would merge the two on
    ranks 0 and 1 only (one all-to-all there, two elsewhere: a hang), is off for the graph."""
    run_ranks(two_slices_equal_to_eager, 4)
