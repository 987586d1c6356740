"""Long-context inference on the compiled model: the prompt's graph runs sequence-parallel and leaves
its key/value cache on the rank's heads (each rank 1/P of it, every position); each decoding step (fewer
new tokens than ranks) projects the rank's heads of q, k and v, attends over the rank's heads of the cache
where they lie, and sums the output projection's partial products (one all-reduce per layer), with no
all-to-all and no gather, and its logits equal eager's (teacher-forced), as do ``generate()``'s tokens,
greedy and sampled, on every rank."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.distributed as dist

from graphs import reporting_backend
from models import tiny_llama, token_batch
from multirank import assert_close, run_ranks

from ulysses_compile.core.boundary import GatheredOnUse
from ulysses_compile.core.sharding import block_sizes

pytestmark = pytest.mark.multirank


def _model(name: str, kv_heads: int):
    if name == "llama":
        return tiny_llama(heads=2 * kv_heads, kv_heads=kv_heads, layers=2)
    if name == "llama-mha":  # as many key/value heads as query heads
        return tiny_llama(heads=kv_heads, kv_heads=kv_heads, layers=2)
    import transformers

    if name == "llama-bias":  # biases on q, k, v and the output projection (attention_bias=True)
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2 * kv_heads,
            num_key_value_heads=kv_heads, attention_bias=True, max_position_embeddings=512))

    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2 * kv_heads,
        num_key_value_heads=kv_heads, head_dim=16, max_position_embeddings=2048))


def _cache_bytes_on_heads(cache, kv_heads: int, world_size: int, length: int) -> int:
    """Every layer's keys and values are the rank's block of the kv_heads (balanced: 6 over 4 ranks are
    2, 2, 1, 1) at every position, not read (so not gathered); returns their bytes on this rank."""
    held = 0
    for layer, entry in enumerate(cache.layers):
        for name in ("keys", "values"):
            value = getattr(entry, name)
            assert isinstance(value, GatheredOnUse) and not value.gathered, (layer, name, type(value))
            block = value._block
            assert tuple(block.shape[1:3]) == (block_sizes(kv_heads, world_size)[dist.get_rank()], length), \
                (layer, name, tuple(block.shape))
            held += block.numel() * block.element_size()
    return held


def decoding_on_cache_heads(rank, world_size, name, kv_heads, prompt, steps):
    model = _model(name, kv_heads)
    reference = copy.deepcopy(model)
    ids, _ = token_batch(seq=prompt)
    continuation, _ = token_batch(seq=steps, seed=7)
    reports = []
    compiled = torch.compile(model, backend=reporting_backend(reports))
    with torch.no_grad():
        got, want = compiled(input_ids=ids, use_cache=True), reference(input_ids=ids, use_cache=True)
        (prefill,) = reports
        assert len(prefill.attention_sites) == 2 and not prefill.replicated, str(prefill)
        kinds = [call.kind for call in prefill.collectives]  # each site's q, k, v to heads and back
        assert kinds.count("seq_to_heads_qkv") == kinds.count("heads_to_seq") == 2 and "gather_seq" not in kinds, kinds
        cache, want_cache = got.past_key_values, want.past_key_values
        held = _cache_bytes_on_heads(cache, kv_heads, world_size, prompt)
        whole = sum(tensor.numel() * tensor.element_size() for layer in want_cache.layers
                    for tensor in (layer.keys, layer.values))
        share = block_sizes(kv_heads, world_size)[rank]
        assert held * kv_heads == whole * share, (held, whole)  # the rank's heads' share of eager's cache bytes
        assert_close(f"rank {rank} prompt logits", got.logits, want.logits)
        for step in range(steps):
            token = continuation[:, step:step + 1]
            got = compiled(input_ids=token, past_key_values=cache, use_cache=True)
            want = reference(input_ids=token, past_key_values=want_cache, use_cache=True)
            assert_close(f"rank {rank} logits of step {step}", got.logits, want.logits)
            cache, want_cache = got.past_key_values, want.past_key_values
            _cache_bytes_on_heads(cache, kv_heads, world_size, prompt + step + 1)
    decoding = reports[1:]
    assert decoding and all(site.on_cache_heads for report in decoding for site in report.attention_sites), \
        [site.summary() for report in decoding for site in report.attention_sites]
    # one graph for the first step's length, one for every later length: the cache's is not split, so no
    # graph per remainder mod P (past Dynamo's limit of 8 graphs, decoding would run eagerly)
    assert len(decoding) == 2, [site.summary() for report in decoding for site in report.attention_sites]
    for report in decoding:
        kinds = [call.kind for call in report.collectives]
        # one all-reduce per layer (the output projection's partial sums), nothing gathered or exchanged
        assert not report.replicated and kinds.count("reduce_partial") == len(report.attention_sites) == 2, kinds
        assert not {"seq_to_heads", "seq_to_heads_qkv", "heads_to_seq", "gather_kv_heads", "gather_seq"} & set(kinds), kinds
    for layer, (entry, want_entry) in enumerate(zip(cache.layers, want_cache.layers)):
        assert_close(f"rank {rank} layer {layer} keys", entry.keys, want_entry.keys)  # read: gathered over heads
        assert_close(f"rank {rank} layer {layer} values", entry.values, want_entry.values)


@pytest.mark.parametrize("name, kv_heads, rank, heads_read, kv_read", [
    ("llama", 4, 1, 2, 1),  # 8 query heads, 4 key/value heads, head dim 8, hidden 64
    ("llama-mha", 6, 3, 1, 1),  # 6 heads over 4 ranks: 2, 2, 1, 1; hidden 48
    ("llama-bias", 4, 1, 2, 1),  # biases on q, k, v and o: the output's added by the first rank only
])
def test_a_decoding_step_reads_the_rank_rows_of_the_attention_weights(fake_group, name, kv_heads, rank, heads_read,
                                                                        kv_read):
    """At P = 4 (one process): the q, k and v projections of a decoding step read the weight's rows of
    the rank's heads (whole heads, also where the heads split unevenly), the output projection its
    columns of them, and their partial products are summed by one all-reduce per layer; the MLP and the
    LM head read their whole weights."""
    from ulysses_compile.backend import ulysses
    from ulysses_compile.core.collectives import reduce_partial, scatter_seq

    fake_group(4, rank)
    model, graphs = _model(name, kv_heads), []
    hidden, head_dim = model.config.hidden_size, model.config.head_dim

    def capture(gm, example_inputs):
        compiled = ulysses(gm, example_inputs, options={"compiler": "eager"})
        graphs.append(gm)
        return compiled

    compiled = torch.compile(model, backend=capture)
    ids, _ = token_batch(seq=16)
    with torch.no_grad():
        cache = compiled(input_ids=ids, use_cache=True).past_key_values
        compiled(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)
    step = graphs[-1]
    sites = step.meta["ulysses_report"].attention_sites
    assert len(sites) == 2 and all(site.on_cache_heads and "1 new position," in site.decision for site in sites)
    read = {}  # weight -> (the dim sliced to the rank's block, or None; the shape read)
    for node in step.graph.nodes:
        if node.op == "call_function" and node.target is torch._C._nn.linear:
            weight = node.args[1]
            sliced = weight.op == "call_function" and weight.target is scatter_seq
            name = re.search(r"(layers_modules_\d+_modules_\w+?_modules_\w+?|lm_head)_parameters",
                             (weight.args[0] if sliced else weight).name).group(1)
            read[name.replace("_modules_", ".")] = (weight.kwargs["dim"] if sliced else None,
                                                   tuple(weight.meta["val"].shape))
    for layer in ("layers.0", "layers.1"):
        assert read[f"{layer}.self_attn.q_proj"] == (0, (heads_read * head_dim, hidden))
        assert read[f"{layer}.self_attn.k_proj"] == read[f"{layer}.self_attn.v_proj"] == (0, (kv_read * head_dim, hidden))
        assert read[f"{layer}.self_attn.o_proj"] == (1, (hidden, heads_read * head_dim))
        assert {read[f"{layer}.mlp.{name}"][0] for name in ("gate_proj", "up_proj", "down_proj")} == {None}
    assert read["lm_head"][0] is None
    reductions = [node for node in step.graph.nodes if node.op == "call_function" and node.target is reduce_partial]
    assert [node.args[0].args[1].args[0].name for node in reductions] == [
        f"l_args_0_modules_model_modules_layers_modules_{layer}_modules_self_attn_modules_o_proj_parameters_weight_"
        for layer in (0, 1)]


def a_second_prompt_over_the_cache(rank, world_size):
    model = _model("llama", 2)
    reference = copy.deepcopy(model)
    ids, _ = token_batch(seq=64)
    turn, _ = token_batch(seq=16, seed=7)
    reports = []
    compiled = torch.compile(model, backend=reporting_backend(reports))
    with torch.no_grad():
        got, want = compiled(input_ids=ids, use_cache=True), reference(input_ids=ids, use_cache=True)
        got = compiled(input_ids=turn, past_key_values=got.past_key_values, use_cache=True)
        want = reference(input_ids=turn, past_key_values=want.past_key_values, use_cache=True)
        assert_close(f"rank {rank} second prompt's logits", got.logits, want.logits)
        _cache_bytes_on_heads(got.past_key_values, 2, world_size, 64 + 16)
        second = reports[-1]
        kinds = [call.kind for call in second.collectives]
        assert all(site.kv_on_cache_heads for site in second.attention_sites) and not second.replicated, str(second)
        # per layer: the new keys and values joined to the cache's heads and q sent to heads (3 all-to-alls),
        # the output back (1); the cache neither gathered nor sent
        assert kinds.count("seq_to_heads") == 3 * 2 and kinds.count("heads_to_seq") == 2, kinds
        assert not {"gather_seq", "seq_to_heads_qkv", "gather_kv_heads"} & set(kinds), kinds
        token = turn[:, -1:]
        step = compiled(input_ids=token, past_key_values=got.past_key_values, use_cache=True)
        want_step = reference(input_ids=token, past_key_values=want.past_key_values, use_cache=True)
        assert_close(f"rank {rank} logits of the step after it", step.logits, want_step.logits)
        assert all(site.on_cache_heads for site in reports[-1].attention_sites)
        _cache_bytes_on_heads(step.past_key_values, 2, world_size, 64 + 16 + 1)


def test_a_second_prompt_over_the_cache_keeps_it_on_the_heads():
    """A second turn (16 new tokens, P or more) over the cache the first left on the rank's heads: its
    keys and values joined to the cache's heads, q alone sent to the heads, the cache never gathered;
    logits equal to eager's, and the decoding step after it on the heads again."""
    run_ranks(a_second_prompt_over_the_cache, 2)


def _agreed_prefix(tokens: torch.Tensor, logits: tuple, new: int) -> int:
    """How many of eager's new greedy tokens are decided: up to the first step whose top-2 logits are
    within 1e-3 (a near tie, which rounding may flip)."""
    for step, step_logits in enumerate(logits):
        top = step_logits.topk(2, dim=-1).values
        if (top[:, 0] - top[:, 1]).min() < 1e-3:
            return step
    return new


def generated_equal_to_eager(rank, world_size):
    model = _model("llama", 2)
    reference = copy.deepcopy(model)
    ids, _ = token_batch(seq=48)
    reports = []
    model.compile(backend=reporting_backend(reports))
    new = 8
    got = model.generate(ids, max_new_tokens=new, do_sample=False)
    want = reference.generate(ids, max_new_tokens=new, do_sample=False, output_logits=True,
                              return_dict_in_generate=True)
    decided = _agreed_prefix(want.sequences, want.logits, new)
    assert decided > 0 and torch.equal(got[:, :48 + decided], want.sequences[:, :48 + decided]), (got, want.sequences)
    assert len(reports) > 1 and all(site.on_cache_heads and not report.replicated
                                    for report in reports[1:] for site in report.attention_sites)
    torch.manual_seed(5)
    sampled = model.generate(ids, max_new_tokens=new, do_sample=True, top_k=0)
    torch.manual_seed(5)
    want_sampled = reference.generate(ids, max_new_tokens=new, do_sample=True, top_k=0)
    everyone = [None] * world_size
    dist.all_gather_object(everyone, sampled.tolist())
    assert all(tokens == everyone[0] for tokens in everyone), everyone  # the same draws on every rank
    assert torch.equal(sampled, want_sampled), (sampled, want_sampled)
    padded = torch.ones_like(ids)
    padded[1, :6] = 0  # a left-padded row: the prompt's mask is a tensor, each step's too
    model.generation_config.pad_token_id = reference.generation_config.pad_token_id = 0
    reports.clear()
    got = model.generate(ids, attention_mask=padded, max_new_tokens=4, do_sample=False)
    want_padded = reference.generate(ids, attention_mask=padded, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, want_padded), (got, want_padded)
    assert len(reports) > 1 and all(site.on_cache_heads and not report.replicated for report in reports[1:]
                                    for site in report.attention_sites), [str(report) for report in reports]
    verified, reports = _model("llama", 2), []
    verified.compile(backend=reporting_backend(reports, verify="short"), dynamic=True)
    checked = 48 + min(decided, 3)
    assert torch.equal(verified.generate(ids, max_new_tokens=3, do_sample=False)[:, :checked],
                       want.sequences[:, :checked])
    prompt, step = reports  # every length at once: the prompt checked on a short one, decoding has none
    assert any("verify='short': at sequence length" in note for note in prompt.notes), prompt.notes
    assert any("a decoding step over a key/value cache" in note for note in step.notes), step.notes


@pytest.mark.parametrize("name, world_size, kv_heads, prompt", [
    pytest.param("llama", 2, 2, 64, id="llama-P2"),
    pytest.param("llama-bias", 2, 2, 64, id="llama-attention-bias-P2"),
    pytest.param("llama", 4, 4, 1024, id="llama-P4-1024", marks=pytest.mark.slow),
    pytest.param("qwen3", 2, 2, 1024, id="qwen3-P2-1024", marks=pytest.mark.slow),
    pytest.param("qwen3", 4, 4, 1024, id="qwen3-P4-1024", marks=pytest.mark.slow),
    pytest.param("llama-mha", 4, 6, 64, id="llama-6-heads-P4", marks=pytest.mark.slow),  # 2, 2, 1, 1 heads
])
def test_decoding_reads_the_rank_heads_of_the_cache_equal_to_eager(name, world_size, kv_heads, prompt):
    run_ranks(decoding_on_cache_heads, world_size, name, kv_heads, prompt, 4)


def test_generate_on_the_compiled_model_equals_eager():
    """``model.compile(backend=...)`` then ``model.generate()``, unchanged: greedy tokens eager's (up to a
    near tie), sampled tokens with one seed the same on every rank and eager's, a left-padded batch's
    tokens eager's (its masks tensors, decoding still on the cache's heads); under ``verify="short"``
    (``dynamic=True``) the prompt's graph is checked and the decoding step's passes unchecked."""
    run_ranks(generated_equal_to_eager, 2)
