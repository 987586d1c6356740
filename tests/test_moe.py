"""Mixture-of-experts layers on each rank's tokens: routing, dispatch, the experts and the auxiliary
losses run on the rank's S/P tokens, nothing gathered, equal to eager on real gloo ranks."""

from __future__ import annotations

import copy

import pytest
import torch

import moe_gpt
from graphs import reporting_backend, rewritten_graphs
from models import VOCAB, token_batch
from multirank import assert_close, compare_model, run_ranks
from op_probes import PROBES

SEQ = 24


def _hf_moe(name: str, experts: str = "grouped_mm", jitter: float = 0.0):
    import transformers as t

    torch.manual_seed(0)
    shared = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, num_experts_per_tok=2, max_position_embeddings=64)
    if name == "mixtral":  # Mixtral's load-balancing loss joins the loss
        config = t.MixtralConfig(intermediate_size=32, num_local_experts=4, output_router_logits=True,
                                 router_aux_loss_coef=0.1, router_jitter_noise=jitter, **shared)
        model = t.MixtralForCausalLM(config)
    elif name == "qwen3_moe":  # a shared expert-free MoE with its own top-k normalisation, and its aux loss
        config = t.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                                  output_router_logits=True, router_aux_loss_coef=0.1, **shared)
        model = t.Qwen3MoeForCausalLM(config)
    elif name == "dbrx":  # its router's top-k crosses a graph break: the graph after it has only lazy blocks in
        config = t.DbrxConfig(d_model=32, n_heads=4, n_layers=2, max_seq_len=64, vocab_size=VOCAB,
                              attn_config={"kv_n_heads": 2, "rope_theta": 500000.0, "clip_qkv": 8.0},
                              ffn_config={"moe_num_experts": 4, "moe_top_k": 2, "ffn_hidden_size": 32})
        model = t.DbrxForCausalLM(config)
    else:  # DeepSeek-V3: sigmoid scores, a bias for the choice, group-limited routing, a shared expert
        shared.update(num_key_value_heads=4, head_dim=None)
        config = t.DeepseekV3Config(intermediate_size=64, moe_intermediate_size=16, n_shared_experts=1,
                                    n_routed_experts=4, n_group=2, topk_group=1, first_k_dense_replace=0,
                                    q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8,
                                    v_head_dim=8, **{k: v for k, v in shared.items() if v is not None})
        model = t.DeepseekV3ForCausalLM(config)
    model.config._experts_implementation = experts
    for module in model.modules():
        if getattr(module, "config", None) is not None:
            module.config._experts_implementation = experts
    ids, labels = token_batch(seq=SEQ)
    return model, {"input_ids": ids, "labels": labels, "use_cache": False}


CASES = {
    "mixtral": lambda: _hf_moe("mixtral"),
    "mixtral_batched_mm": lambda: _hf_moe("mixtral", "batched_mm"),
    "mixtral_jitter": lambda: _hf_moe("mixtral", jitter=0.1),
    "qwen3_moe": lambda: _hf_moe("qwen3_moe"),
    "dbrx": lambda: _hf_moe("dbrx"),
    "deepseek_v3": lambda: _hf_moe("deepseek_v3"),
    "moe_gpt_sorted": lambda: _plain("sorted"),
    "moe_gpt_dense": lambda: _plain("dense"),
}


def _plain(dispatch: str):
    model, (ids,), kwargs = moe_gpt.make(seq_len=SEQ, dispatch=dispatch)
    return model, {"idx": ids, **kwargs}


def _results(output) -> dict:
    if isinstance(output, tuple):
        logits, loss = output
        return {"loss": loss, "logits": logits}
    results = {"loss": output.loss, "logits": output.logits}
    if getattr(output, "aux_loss", None) is not None:
        results["aux_loss"] = output.aux_loss
    for layer, router_logits in enumerate(getattr(output, "router_logits", None) or ()):
        results[f"router_logits {layer}"] = router_logits
    return results


# KV heads of each case (of 4 query heads): at ranks that do not divide them they are gathered
KV_HEADS = {"mixtral": 2, "mixtral_batched_mm": 2, "mixtral_jitter": 2, "qwen3_moe": 2, "dbrx": 2, "deepseek_v3": 4,
            "moe_gpt_sorted": 4, "moe_gpt_dense": 4}


# DBRX picks each expert's tokens with torch.where in Python: Dynamo breaks the graph there, and the expert
# graphs after the breaks receive whole tensors (docs/limits.md). Its attention is parallel; the router's
# outputs cross the first break as lazy blocks into a graph with no other input.
EXPERTS_AFTER_BREAKS = {"dbrx"}


def _assert_token_local(reports, kv_gathered: bool) -> None:
    """Every attention parallelized by all-to-alls and nothing gathered, in every graph (router jitter's
    noise is drawn whole, as one process draws it, gathering nothing); a graph without attention
    (Mixtral's loss, after transformers' router-logit capture ends the graph) runs on the blocks the
    graph before it left, the hidden states and router logits crossing to it ungathered."""
    with_attention = [report for report in reports if report.attention_sites]
    assert with_attention, [str(report) for report in reports]
    for report in with_attention:
        assert not report.replicated, str(report)
        assert all("parallelized" in site.decision for site in report.attention_sites), str(report)
        # q, k and v turned to heads: in one all-to-all, or, with fewer KV heads than ranks, q by its own
        # and k and v gathered
        kinds = [c.kind for c in report.collectives]
        sites = len(report.attention_sites)
        counted = [kinds.count(kind) for kind in ("seq_to_heads_qkv", "seq_to_heads", "gather_kv_heads", "heads_to_seq")]
        assert counted == ([0, sites, 2 * sites, sites] if kv_gathered else [sites, 0, 0, sites]), str(report)
        assert all(f.reason.endswith("(nothing gathered)") for f in report.fallbacks), str(report)
    for report in reports:
        assert not report.replicated and not report.gathered_outputs, str(report)
        assert all(f.reason.endswith("(nothing gathered)") for f in report.fallbacks), str(report)


def moe_equal_to_eager(rank, world_size, names):
    for name in names:
        model, inputs = CASES[name]()
        reference = copy.deepcopy(model)
        reports = []
        backend = reporting_backend(reports)

        torch.compiler.reset()
        torch.manual_seed(0)  # router jitter draws as eager does
        got = _results(torch.compile(model, backend=backend)(**inputs))
        if name in EXPERTS_AFTER_BREAKS:
            sites = [site for report in reports for site in report.attention_sites]
            assert len(sites) == 2 and all("parallelized" in site.decision for site in sites), sites
            kinds = [c.kind for report in reports for c in report.collectives]
            # per site: q, k and v to heads in one all-to-all, or past the KV heads (2 at P = 4) q in one
            # and k and v each gathered for the rank's KV head; the output back in one
            to_heads = {"seq_to_heads": 2, "gather_kv_heads": 4} if KV_HEADS[name] % world_size else \
                {"seq_to_heads_qkv": 2}
            assert {kind: kinds.count(kind) for kind in (*to_heads, "heads_to_seq")} == {**to_heads, "heads_to_seq": 2}, kinds
        else:
            _assert_token_local(reports, kv_gathered=KV_HEADS[name] % world_size != 0)
        got["loss"].backward()
        torch.manual_seed(0)
        want = _results(reference(**inputs))
        want["loss"].backward()
        assert got.keys() == want.keys()
        assert name not in ("mixtral", "qwen3_moe") or want["aux_loss"].item() > 0 and "router_logits 1" in got
        compare_model(rank, model, reference, {f"{name} {key}": (got[key], want[key]) for key in got})


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_moe_models_run_on_the_ranks_tokens(world_size):
    """Mixtral (with its load-balancing loss; and with router jitter), Qwen3-MoE, DeepSeek-V3 (group-limited routing, shared
    expert) with transformers' default grouped experts, Mixtral with batched experts, and a plain-PyTorch
    top-k MoE (sorted and dense dispatch, load-balancing and z-losses): loss, logits, auxiliary loss and
    every gradient equal eager; every attention parallel; nothing gathered."""
    names = list(CASES) if world_size == 4 else ["mixtral", "deepseek_v3", "moe_gpt_sorted", "dbrx"]
    run_ranks(moe_equal_to_eager, world_size, names)


@pytest.mark.slow
@pytest.mark.multirank
def test_more_moe_forms_at_two_ranks():
    run_ranks(moe_equal_to_eager, 2, ["mixtral_jitter", "moe_gpt_dense", "mixtral_batched_mm", "qwen3_moe"])


@pytest.mark.parametrize("name", ["top_k_gates", "sorted_rows_put_back", "sorted_rows_added_back",
                                  "sorted_rows_scattered_back"])
def test_routing_probes_gather_nothing(fake_group, name):
    fake_group(2)
    graphs = rewritten_graphs(PROBES[name](), (torch.randint(0, 32, (2, 15)),))
    reports = [gm.meta["ulysses_report"] for gm in graphs]
    assert [f for report in reports for f in report.fallbacks] == []


def test_sorted_rows_read_out_of_order_sort_the_whole_sequence(fake_group):
    """Sorted rows read before they are put back in token order have no per-rank meaning: the sort
    runs on the gathered sequence, and the report names the reader."""
    fake_group(2)
    (gm,) = rewritten_graphs(PROBES["sorted_rows_read_unordered"](), (torch.randint(0, 32, (2, 15)),))
    fallbacks = gm.meta["ulysses_report"].fallbacks
    assert [f.op for f in fallbacks] == ["argsort", "getitem"], fallbacks
    assert "reads its rows before they are put back in token order" in fallbacks[0].reason


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_explain_shows_moe_blocks_on_the_ranks_tokens(name):
    """``explain`` at 4 ranks, one process: the MoE blocks and, with the router logits output (the
    auxiliary loss), the loss graph after transformers' capture gather nothing (the only all-gathers
    are of the 2 KV heads, fewer than the ranks); the experts' weights have their gradients summed
    over the ranks."""
    from ulysses_compile import explain

    model, inputs = CASES[name]()
    report = explain(model, **inputs, world_size=4)
    assert report.fallbacks == [] and len(report.attention_sites) == 2, str(report)
    assert len(report.graphs) == 2 and not any(g.replicated or g.gathered_outputs for g in report.graphs), str(report)
    assert {c.purpose for c in report.collectives if c.kind == "all_gather"} == {"gather_kv_heads"}, str(report)
    assert any(c.purpose == "sync_grad" and c.where.endswith("mlp.experts") for c in report.collectives), str(report)


def _all_to_alls(report) -> list[int]:
    """A graph's all-to-alls to heads (q, k and v in one) and back."""
    kinds = [c.kind for c in report.collectives]
    return [kinds.count("seq_to_heads_qkv"), kinds.count("heads_to_seq")]


def split_dispatch_trains_like_eager(rank, world_size):
    """torchtitan's loop over experts: the token counts read with ``.tolist()``, the sorted rows
    ``torch.split`` by them. Dynamo captures the counts as unbacked ints (the backend's tracing
    settings), so each MoE layer stays in the one graph and every rank splits its own sorted rows at
    its own counts, which differ across ranks (checked on the eager model's routing of each rank's
    tokens): one graph compiled once on every rank through 4 SGD steps on changing batches, every
    attention parallel, nothing gathered, the loss and every parameter as eager's."""
    model, (ids,), kwargs = moe_gpt.make(seq_len=SEQ, dispatch="split")
    reference = copy.deepcopy(model)
    routed = []
    for block in reference.transformer.h:
        block.mlp.router.register_forward_hook(lambda module, args, out: routed.append(out.topk(2, dim=-1).indices))
    reports = []
    torch.compiler.reset()
    compiled = torch.compile(model, backend=reporting_backend(reports, as_named=True))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]  # (Adam turns a key bias's zero gradient, noise, into steps)
    compiles, own_counts = [], []
    for step in range(4):
        generator = torch.Generator().manual_seed(step)
        data = torch.randint(0, model.config.vocab_size, (2, SEQ + 1), generator=generator)
        inputs, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()
        losses = []
        for module, optimizer in zip((compiled, reference), optimizers):
            optimizer.zero_grad()
            loss = module(inputs, targets=targets)[1]
            loss.backward()
            losses.append(loss)
        compare_model(rank, model, reference, {f"step {step} loss": tuple(losses)})
        for optimizer in optimizers:
            optimizer.step()
        compiles.append(len(reports))
        for experts in routed:  # [B*S, k] in token order: this rank's tokens are its block of each sequence
            block = experts.view(2, SEQ, 2)[:, rank * SEQ // world_size: (rank + 1) * SEQ // world_size]
            own_counts.append(torch.bincount(block.reshape(-1), minlength=4).tolist())
        routed.clear()
    everyone = [None] * world_size
    torch.distributed.all_gather_object(everyone, (compiles, own_counts))
    assert all(other[0] == [1, 1, 1, 1] for other in everyone), everyone
    assert any(first != second for first, second in zip(everyone[0][1], everyone[1][1])), everyone
    (report,) = reports
    assert len(report.attention_sites) == model.config.n_layer and not report.replicated, str(report)
    assert _all_to_alls(report) == [model.config.n_layer] * 2, report.collectives
    assert report.fallbacks == [] and not report.gathered_outputs, str(report)
    assert not any(c.kind.startswith("gather") for c in report.collectives), report.collectives
    for name, parameter in model.named_parameters():
        assert_close(f"rank {rank} {name} after 4 steps", parameter, dict(reference.named_parameters())[name])


@pytest.mark.multirank
def test_an_moe_reading_its_counts_with_tolist_splits_each_ranks_own_rows():
    run_ranks(split_dispatch_trains_like_eager, 2)


def test_explain_lists_every_layer_of_an_moe_reading_its_counts():
    """On the fake process group too, the rank splits its rows at its own counts (a reduction there
    returns the rank's term, which a split by the global counts would not fit): one graph, a site per
    layer, nothing run whole."""
    from ulysses_compile import explain

    model, (ids,), kwargs = moe_gpt.make(seq_len=SEQ, dispatch="split")
    report = explain(model, ids, world_size=2, **kwargs)
    assert len(report.graphs) == 1 and len(report.attention_sites) == model.config.n_layer, str(report)
    assert not report.graphs[0].replicated and report.graphs[0].fallbacks == [], str(report)
    to_heads = [c for c in report.collectives if c.phase == "forward" and c.kind == "all_to_all"]
    assert len(to_heads) == 2 * model.config.n_layer, report.collectives  # q, k, v to heads and back, per layer


class SplitSpellings(moe_gpt.MoE):
    """Other ways to write the split over experts: torchtitan's keyword and the ``histc(ids, E, 0, E - 1)``
    range (split on each rank's own rows); and three the split rule must not take for a split at the
    rank's own counts (each then runs its sort whole, exact): a descending sort split at the reversed
    counts, the pieces joined in reverse, and torchtitan's padded rows (``x[:sum(counts)]``)."""

    spelling = "keyword"

    def forward(self, x):
        B, T, C = x.shape
        x = x.reshape(-1, C)
        probs = self.router(x).softmax(dim=-1)
        gates, experts = probs.topk(self.top_k, dim=-1)
        self.aux_loss, self.z_loss = probs.mean(), probs.square().mean()
        flat = experts.reshape(-1)
        counts = torch.histc(flat.float(), bins=self.n_expert, min=0, max=self.n_expert - 1)
        descending = self.spelling == "descending"
        order = flat.argsort(stable=True, descending=descending)
        tokens = order // self.top_k
        sizes = counts.long().tolist()[::-1] if descending else counts.long().tolist()
        rows = x[tokens][: sum(sizes)] if self.spelling == "padded" else x[tokens]
        chunks = torch.split(rows, split_size_or_sections=sizes, dim=0)
        experts_of = range(self.n_expert - 1, -1, -1) if descending else range(self.n_expert)
        outs = [torch.nn.functional.gelu(chunk @ self.w_in[e]) @ self.w_out[e] for e, chunk in zip(experts_of, chunks)]
        y = torch.cat(outs[::-1] if self.spelling == "reversed_cat" else outs)
        out = torch.zeros_like(x).index_add_(0, tokens, y * gates.reshape(-1)[order].unsqueeze(-1))
        return out.reshape(B, T, C)


def split_spellings_equal_eager(rank, world_size, spellings):
    for spelling in spellings:
        model, (ids,), kwargs = moe_gpt.make(seq_len=SEQ, dispatch="split")
        for block in model.transformer.h:
            block.mlp.__class__, block.mlp.spelling = SplitSpellings, spelling
        reference = copy.deepcopy(model)
        reports = []
        torch.compiler.reset()
        loss = torch.compile(model, backend=reporting_backend(reports, as_named=True))(ids, **kwargs)[1]
        loss.backward()
        want = reference(ids, **kwargs)[1]
        want.backward()
        compare_model(rank, model, reference, {f"{spelling} loss": (loss, want)})
        (report,) = reports
        assert len(report.attention_sites) == model.config.n_layer and not report.replicated, str(report)
        assert _all_to_alls(report) == [model.config.n_layer] * 2, report.collectives
        whole_sorts = [fallback for fallback in report.fallbacks if fallback.op == "argsort"]
        assert len(whole_sorts) == (0 if spelling == "keyword" else model.config.n_layer), (spelling, str(report))


@pytest.mark.multirank
@pytest.mark.parametrize("spellings", [("keyword", "reversed_cat"),
                                       pytest.param(("descending", "padded"), marks=pytest.mark.slow)])
def test_other_spellings_of_the_expert_split_are_exact_and_only_the_rank_local_ones_split_locally(spellings):
    run_ranks(split_spellings_equal_eager, 2, spellings)
