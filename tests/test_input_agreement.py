"""The per-call check that the ranks pass the same inputs (``agreement.InputCheck``): its fingerprint
tells reordered values apart (swaps at any distance, reversed or permuted rows, zero-mean rows), and
ranks whose batches differ only so get a ``RankMismatchError`` before the first call runs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from models import tiny_llama, token_batch
from multirank import assert_close, run_ranks
from ulysses_compile import RankMismatchError
from ulysses_compile.agreement import _FLOAT_WEIGHT, _fingerprint


def _differ(first: torch.Tensor, second: torch.Tensor) -> bool:
    """Whether ``InputCheck`` would tell the two inputs apart (floating: beyond its tolerance)."""
    (one, floating), (other, _) = _fingerprint(first), _fingerprint(second)
    if not floating:
        return any(a.item() != b.item() for a, b in zip(one, other))
    tolerance = 1e-6 * _FLOAT_WEIGHT * one[1].item()
    return any(abs(a.item() - b.item()) > tolerance for a, b in zip(one, other))


def _reordered(value: torch.Tensor, how: str, data) -> torch.Tensor:
    flat = value.clone().reshape(-1)
    if how == "swap":  # floating: values apart by more than rounding (the check's tolerance) could explain
        i = data.draw(st.integers(0, flat.numel() - 2))
        apart = (flat - flat[i]).abs() > (1.0 if flat.is_floating_point() else 0)
        candidates = [j for j in apart.nonzero().view(-1).tolist() if j > i]
        if not candidates:
            return value
        j = data.draw(st.sampled_from(candidates))
        flat[[i, j]] = flat[[j, i]]
        return flat.view(value.shape)
    rows = value.reshape(-1, value.shape[-1])
    if how == "reverse rows":
        return rows.flip(0).reshape(value.shape)
    order = data.draw(st.permutations(range(rows.shape[0])).filter(lambda p: list(p) != sorted(p)))
    return rows[list(order)].reshape(value.shape)


@settings(max_examples=60, deadline=None, database=None, derandomize=True)
@given(data=st.data(), floating=st.booleans(), rows=st.integers(2, 40), width=st.sampled_from([2, 16, 1021, 1024]),
       how=st.sampled_from(["swap", "reverse rows", "permute rows"]), seed=st.integers(0, 2**16))
def test_the_fingerprint_tells_reordered_inputs_apart(data, floating, rows, width, how, seed):
    """Integer inputs: any reordering; floating ones: one beyond rounding (rows of mean zero reordered,
    two values more than 1 apart swapped)."""
    generator = torch.Generator().manual_seed(seed)
    if floating:  # rows of mean zero: their sum is the same wherever they stand
        value = torch.randn(rows, width, generator=generator)
        value = value - value.mean(-1, keepdim=True)
    else:
        value = torch.randint(0, 32000, (rows, width), generator=generator)
    reordered = _reordered(value, how, data)
    if torch.equal(reordered, value):  # (integer data or a permutation of equal rows: the same input)
        return
    assert _differ(value, reordered), (how, rows, width)
    assert not _differ(value, value.clone())


def test_the_fingerprint_of_a_swap_at_the_former_weight_period():
    """input_ids [4, 256] with two tokens 1021 positions apart swapped: the sum weighted by positions
    modulo 1021 the check used missed it."""
    ids = torch.randint(0, 32000, (4, 256), generator=torch.Generator().manual_seed(0))
    swapped = ids.clone().view(-1)
    swapped[[2, 2 + 1021]] = swapped[[2 + 1021, 2]]
    assert _differ(ids, swapped.view(4, 256))


def reordered_batches_are_refused(rank, world_size):
    """A batch reordered on one rank, its shape and sums unchanged: refused at the first call."""
    ids, labels = token_batch(seq=256, batch=4)
    model = tiny_llama(layers=1)
    if rank == 1:
        flat = ids.clone().view(-1)
        flat[[2, 2 + 1021]] = flat[[2 + 1021, 2]]
        ids = flat.view(ids.shape)
    compiled = torch.compile(model, backend="ulysses", options={"compiler": "eager"})
    with pytest.raises(RankMismatchError, match=r"different values in input_ids to .*its first call"):
        compiled(input_ids=ids, labels=labels, use_cache=False)
    torch.compiler.reset()
    embeds = torch.randn(2, 32, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    embeds = embeds - embeds.mean(-1, keepdim=True)
    if rank == 1:
        embeds = embeds[:, torch.arange(31, -1, -1)]
    compiled = torch.compile(model, backend="ulysses", options={"compiler": "eager"})
    with pytest.raises(RankMismatchError, match=r"different values in inputs_embeds to .*its first call"):
        compiled(inputs_embeds=embeds, use_cache=False)


@pytest.mark.multirank
def test_reordered_batches_are_refused_on_every_rank():
    run_ranks(reordered_batches_are_refused, 2)


def module_states_agree_or_are_synced(rank, world_size):
    """A model built after a per-rank seed, and a buffer changed on one rank (rotary ``inv_freq``): the
    first call refuses to run, naming the tensors, on every rank; under ``parallelize`` before anything
    is partitioned. With ``sync_module_states`` rank 0's values are broadcast and the step equals rank
    0's model in eager, loss and every gradient."""
    import copy

    from multirank import compare_model
    from ulysses_compile import parallelize

    ids, labels = token_batch(seq=32)
    batch = {"input_ids": ids, "labels": labels, "use_cache": False}
    own = tiny_llama(layers=1, seed=rank)
    with pytest.raises(RankMismatchError, match=rf"rank {rank}: compiled graph .*different parameters or buffers "
                                                r"\(model\.embed_tokens\.weight, .*sync_module_states"):
        torch.compile(own, backend="ulysses", options={"compiler": "eager"})(**batch)
    torch.compiler.reset()
    with pytest.raises(RankMismatchError, match=r"parallelize: the ranks hold different parameters"):
        parallelize(tiny_llama(layers=1, seed=rank), zero_stage=3, compiler="eager")
    shifted = tiny_llama(layers=1)
    if rank == 1:
        shifted.model.rotary_emb.inv_freq.mul_(1.5)
    with pytest.raises(RankMismatchError, match=r"different parameters or buffers \(model\.rotary_emb\.inv_freq;"):
        torch.compile(shifted, backend="ulysses", options={"compiler": "eager"})(**batch)
    torch.compiler.reset()
    flipped = tiny_llama(layers=1)
    if rank == 1:
        with torch.no_grad():
            flipped.model.norm.weight[3] *= -1  # one element's sign
    with pytest.raises(RankMismatchError, match=r"different parameters or buffers \(model\.norm\.weight;"):
        torch.compile(flipped, backend="ulysses", options={"compiler": "eager"})(**batch)
    torch.compiler.reset()

    reference = tiny_llama(layers=1, seed=0)  # rank 0's model
    for compiled, model in ((torch.compile(own, backend="ulysses", options={"compiler": "aot_eager",
                                                                            "sync_module_states": True}), own),
                            (parallelize(tiny_llama(layers=1, seed=rank), zero_stage=3, compiler="aot_eager",
                                         sync_module_states=True), None)):
        eager = copy.deepcopy(reference)
        got = compiled(**batch)
        got.loss.backward()
        want = eager(**batch)
        want.loss.backward()
        compare_model(rank, model if model is not None else compiled._orig_mod, eager,
                      {"loss": (got.loss, want.loss), "logits": (got.logits, want.logits)})
        torch.compiler.reset()


@pytest.mark.multirank
def test_module_states_agree_across_ranks_or_are_synced():
    run_ranks(module_states_agree_or_are_synced, 2)


def checks_cost_one_small_all_gather_per_call(rank, world_size):
    """After the first call (which compares what the ranks compiled and hold), the checks add one
    collective to a training step: the input check's all-gather of 64 float64 per rank (512 bytes): the
    call's place (4) and the inputs' fingerprints (4 per integer input: count, sum, two weighted sums;
    8 for input_ids and labels), padded to the fixed size."""
    ids, labels = token_batch(seq=32)
    per_setting, gathered = {}, []
    all_gather = torch.distributed.all_gather_single

    def recorded(output, tensor, *args, **kwargs):
        gathered.append((tuple(tensor.shape), tensor.dtype, tuple(output.shape)))
        return all_gather(output, tensor, *args, **kwargs)

    for check_inputs in (True, False):
        torch.compiler.reset()
        model = torch.compile(tiny_llama(layers=1), backend="ulysses",
                              options={"compiler": "aot_eager", "check_inputs": check_inputs})

        def step():
            model(input_ids=ids, labels=labels, use_cache=False).loss.backward()

        step()
        gathered.clear()
        torch.distributed.all_gather_single = recorded
        try:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
                step()
        finally:
            torch.distributed.all_gather_single = all_gather
        per_setting[check_inputs] = [event.name for event in profile.events() if event.name.startswith("c10d::")]
        if check_inputs:
            assert gathered == [((64,), torch.float64, (64 * world_size,))], gathered  # 512 bytes from each rank
    added = list(per_setting[True])
    for name in per_setting[False]:
        added.remove(name)
    assert added == ["c10d::_allgather_base_"], added


@pytest.mark.multirank
def test_the_checks_add_one_small_all_gather_per_step():
    run_ranks(checks_cost_one_small_all_gather_per_call, 2)


def per_rank_seeds(rank, world_size):
    """Ranks seeded ``100 + rank`` after an identical init, dropout 0.1 on the activations (none inside
    the attention kernel): where the graph computes the dropout whole (a sequence shorter than the
    ranks) each rank would draw its own mask for the same tensor, so the first call is refused on every
    rank; ranks seeded alike run it, and so do ranks seeded apart where every draw is sliced to the
    rank's block (independent blocks, as one device's)."""
    import nanogpt

    for seq, seed, refused in ((1, 100 + rank, True), (1, 100, False), (32, 100 + rank, False)):
        model, (ids,), kwargs = nanogpt.make(seq_len=seq, dropout=0.1)
        for block in model.transformer.h:
            block.attn.dropout = 0.0
        torch.compiler.reset()
        compiled = torch.compile(model, backend="ulysses", options={"compiler": "aot_eager"})
        torch.manual_seed(seed)
        if refused:
            with pytest.raises(RankMismatchError, match="random generators are in different states.*not seed \\+ rank"):
                compiled(ids, **kwargs)
        else:
            compiled(ids, **kwargs)[1].backward()


@pytest.mark.multirank
def test_per_rank_seeds_are_refused_where_a_draw_is_read_whole():
    run_ranks(per_rank_seeds, 2)


def test_random_draws_are_told_from_lookalikes():
    """What the generator check, verify and the causal-mask recognizer count as a draw: dropouts that
    drop, rrelu and alpha dropout only when training, in-place fills, gumbel softmax, attention dropout
    inside the kernel; not a dropout with training=False, ``normalize``, the Poisson loss or attention
    with dropout_p=0."""
    import torch.fx as fx
    import torch.nn.functional as F

    from ulysses_compile.core.random_draws import random_draw

    from ulysses_compile.core.runtime import attention_heads_dropout, flash_attention, flash_attention_varlen

    def forward(x):
        return (F.dropout(x, 0.1, True), F.dropout(x, 0.1, False), torch.dropout(x, 0.1, False), F.dropout2d(x, 0.2),
                F.alpha_dropout(x, 0.2), F.alpha_dropout(x, 0.2, True), F.rrelu(x), F.rrelu(x, training=True),
                torch.rand_like(x), x.uniform_(), x.bernoulli_(0.5), F.gumbel_softmax(x), F.normalize(x),
                F.poisson_nll_loss(x, x), F.scaled_dot_product_attention(x, x, x, dropout_p=0.25),
                F.scaled_dot_product_attention(x, x, x), torch.native_dropout(x, 0.3, True),
                torch.native_dropout(x, 0.3, False), torch.feature_dropout(x, 0.4, True), torch.rrelu(x, 0.1, 0.3, True),
                torch.normal(x, 1.0), torch.multinomial(x, 2), torch.randperm(x.size(0)), torch.lgamma(x),
                torch._dirichlet_grad(x, x, x))

    graph = fx.symbolic_trace(forward).graph
    x = next(iter(graph.nodes))
    for kernel, args in ((flash_attention, (0.5, 1.0, True, (-1, -1), 0.0, None, False)),
                         (flash_attention_varlen, (x, x, 4, 4, 0.0, 1.0, True, (-1, -1), 0.0, None, False))):
        graph.call_function(kernel, (x, x, x, *args))  # (kernels symbolic_trace would run)
    graph.call_function(attention_heads_dropout, (x, x, x, None, 0.125), {"rank": 1})
    drawn = {node.name: random_draw(node) for node in graph.nodes
             if node.op == "call_function" or node.op == "call_method"}
    assert {name: what for name, what in drawn.items() if what is not None} == {
        "dropout": "dropout p=0.1", "dropout2d": "dropout2d p=0.2", "alpha_dropout_1": "alpha_dropout p=0.2",
        "rrelu_1": "rrelu", "rand_like": "rand_like", "uniform_": "uniform_", "bernoulli_": "bernoulli_",
        "gumbel_softmax": "gumbel_softmax", "scaled_dot_product_attention": "attention dropout p=0.25",
        "native_dropout": "native_dropout p=0.3", "feature_dropout": "feature_dropout p=0.4", "rrelu_2": "rrelu",
        "normal": "normal", "multinomial": "multinomial", "randperm": "randperm",
        "flash_attention": "attention dropout p=0.5", "attention_heads_dropout": "attention dropout p=0.125"}, drawn


def test_dropout_blocks_are_parts_of_one_mask_and_only_the_blocks_are_drawn(fake_group):
    """``runtime.dropout_block``: each rank's mask is its block of the mask one rank would draw from the
    same generator state (uneven blocks, a merged ``[B*S, H]`` layout), keeping 1 - p of the elements;
    under Inductor no buffer of the whole sequence's random numbers is allocated, only the block's."""
    import math
    import re

    import nanogpt

    from ulysses_compile.core.collectives import take_block
    from ulysses_compile.core.compat import run_and_get_code
    from ulysses_compile.core.runtime import dropout_block

    for shape, dim, outer, inner in (((2, 63, 16), 1, 1, 1), ((126, 16), 0, 2, 1), ((2, 189), 1, 1, 3)):
        x = torch.ones(shape)
        torch.manual_seed(0)
        whole = dropout_block(x, 0.25, True, shape, dim, outer, inner, 0, 1)
        for rank in range(4):
            torch.manual_seed(0)
            block = take_block(x, dim, outer, inner, rank, 4)
            block = dropout_block(block, 0.25, True, shape, dim, outer, inner, rank, 4)
            assert torch.equal(block, take_block(whole, dim, outer, inner, rank, 4)), (shape, rank)
    torch.manual_seed(0)
    masks = [dropout_block(torch.ones(1, 4096, 64), 0.1, True, (1, 4096, 64), 1, 1, 1, 0, 1) != 0 for _ in range(2)]
    assert not torch.equal(*masks)  # each call draws its own seeds from the generator
    kept = masks[0].float().view(-1)
    assert abs(kept.mean().item() - 0.9) < 0.005, kept.mean()
    neighbours = torch.corrcoef(torch.stack([kept[:-1], kept[1:]]))[0, 1]
    assert abs(neighbours.item()) < 0.02, neighbours

    fake_group(2)
    model, (ids,), kwargs = nanogpt.make(seq_len=64, dropout=0.1, n_layer=1)
    for block in model.transformer.h:
        block.attn.dropout = 0.0  # (the activations' dropout is this test's; SDPA's draws in its kernel)
    compiled = torch.compile(model.train(), backend="ulysses", options={"compiler": "inductor"})
    _, (forward, *_) = run_and_get_code(lambda: compiled(ids, **kwargs))
    sizes = [math.prod(int(size) for size in shape.split(",") if size.strip())
             for shape in re.findall(r"empty_strided_cpu\(\(([\d, ]*)\)", forward)]
    whole = ids.shape[0] * 64 * model.transformer.wte.weight.shape[1]  # (no other buffer has its size here)
    assert sizes and whole not in sizes, sizes


class _SameHeads(torch.nn.Module):
    """Every head attends with the same queries and keys over ``value = I``, so a head's output is its
    dropped-out attention weights: zero exactly where its mask dropped."""

    def __init__(self, heads: int = 4, width: int = 8):
        super().__init__()
        self.heads = heads
        self.proj = torch.nn.Linear(width, width, bias=False)

    def forward(self, x):
        batch, seq, width = x.shape
        q = self.proj(x).unsqueeze(1).expand(batch, self.heads, seq, width)
        v = torch.eye(seq).expand(batch, self.heads, seq, seq)
        return torch.nn.functional.scaled_dot_product_attention(q, q, v, dropout_p=0.5 if self.training else 0.0)


def attention_dropout_per_head(rank, world_size, compiler, seeds):
    """SDPA's dropout split over the ranks' heads: the site runs parallel (its kernel under
    ``attention_heads_dropout``), each head keeps half its weights and no two heads share a mask (heads
    on other ranks included: the generators agree, or differ); the gradient is eager's for the masks
    the forward drew; and (once) a nanoGPT with dropout 0.1 everywhere, attention included, runs every
    site parallel."""
    import nanogpt
    from graphs import reporting_backend

    torch.manual_seed(0)
    model = _SameHeads()
    x, weights = torch.randn(2, 64, 8), torch.randn(2, 4, 64, 64)
    reports = []
    compiled = torch.compile(model, backend=reporting_backend(reports, compiler=compiler))
    torch.manual_seed(100 + (rank if seeds == "apart" else 0))
    out = compiled(x)
    (out * weights).sum().backward()
    (report,) = reports
    assert len(report.attention_sites) == 1 and not report.replicated, str(report)
    assert {c.kind for c in report.collectives} >= {"seq_to_heads_qkv", "heads_to_seq"}, report.collectives
    kept = (out != 0).flatten(2).float()  # [batch, heads, seq * seq]
    assert ((kept.mean(-1) - 0.5).abs() < 0.05).all(), kept.mean(-1)
    for first in range(4):
        for second in range(first + 1, 4):
            agree = (kept[:, first] == kept[:, second]).float().mean()
            assert abs(agree.item() - 0.5) < 0.05, (first, second, agree)  # 1.0 where two heads share a mask

    reference = torch.nn.Linear(8, 8, bias=False)
    reference.load_state_dict(model.proj.state_dict())
    probs = torch.softmax(reference(x) @ reference(x).transpose(1, 2) / 8**0.5, -1)
    ((probs.unsqueeze(1) * kept.view_as(out) / 0.5) * weights).sum().backward()
    assert_close("proj.weight.grad", model.proj.weight.grad, reference.weight.grad)

    if compiler != "aot_eager":
        return
    nanogpt_model, (ids,), kwargs = nanogpt.make(seq_len=32, dropout=0.1)
    reports.clear()
    torch.compile(nanogpt_model, backend=reporting_backend(reports, compiler=compiler))(ids, **kwargs)[1].backward()
    assert [len(r.attention_sites) for r in reports] == [nanogpt_model.config.n_layer], [str(r) for r in reports]
    assert not reports[0].replicated and not reports[0].replicated_draws, str(reports[0])
    assert [c.kind for c in reports[0].collectives].count("heads_to_seq") == nanogpt_model.config.n_layer


@pytest.mark.multirank
@pytest.mark.parametrize("compiler,seeds", [("aot_eager", "alike"), ("inductor", "apart")])
def test_attention_dropout_draws_a_mask_per_head_on_every_rank(compiler, seeds):
    run_ranks(attention_dropout_per_head, 2, compiler, seeds)
