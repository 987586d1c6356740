"""Randomized equivalence with eager: hypothesis draws small transformer configurations (heads, KV heads,
head dim, batch, sequence length, mask, attention implementation, ZeRO stage, compiler) and each one runs
on P real gloo ranks against single-device eager.

The property, for every drawn configuration: the loss, the logits and every parameter gradient equal
eager's within rtol 1e-4 of the reference's magnitude (with ZeRO, whose parameters are flat shards: the
loss, the logits and every full parameter after one SGD step), or, exactly when P exceeds the query heads
and no ring can run the attention (hand-written, or a sequence P does not divide), every rank raises
``DivisibilityError``. The fixed tests check chosen models at chosen sizes; this checks
the combinations nobody chose: lengths that P does not divide or shorter than P, uneven heads, MQA and GQA
through SDPA, transformers' eager attention and hand-written softmax(q @ k^T) @ v, padding masks built from
the inputs, and the ZeRO gathers on top.

Examples are drawn in this process from a fixed seed per P (the same cases on every run) and run on the
persistent rank pools; P = 3 runs on three ranks of the 4-rank pool through the ``group`` option, which
saves a spawn. A failing case restarts its pool, so shrinking is off: the falsifying configuration is
printed whole. ``PROPERTY_EXAMPLES_SCALE=10`` runs ten times as many cases (a sweep by hand).
"""

from __future__ import annotations

import copy
import os
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import Phase, example, given, seed, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

from multirank import assert_close, compare_model, run_ranks
from ulysses_compile import DivisibilityError, full_state_dict, parallelize

VOCAB = 32
MAX_SEQ = 40
EXAMPLES_SCALE = int(os.environ.get("PROPERTY_EXAMPLES_SCALE", "1"))
SGD_LR = 1.0  # parameters move by their whole gradient, so the step compares gradients too


class PlainTransformer(nn.Module):
    """One pre-norm transformer block and an LM head in plain PyTorch, attention written either with
    SDPA (``is_causal``, a boolean key-padding mask, ``enable_gqa``) or by hand as
    ``softmax(q @ k^T * scale + mask) @ v`` with the KV heads repeated by ``repeat_interleave``."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, attention: str, causal: bool):
        super().__init__()
        dim = heads * head_dim
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.attention, self.causal = attention, causal
        self.embed = nn.Embedding(VOCAB, dim)
        self.norm = nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * kv_heads * head_dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, input_ids, labels, attention_mask=None):
        x = self.embed(input_ids)
        b, s, d = x.shape
        h = self.norm(x)
        q = self.q(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(h).view(b, s, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        x = x + self.proj(self._attend(q, k, v, attention_mask).transpose(1, 2).reshape(b, s, d))
        logits = self.head(x + self.mlp(x))
        return logits, F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    def _attend(self, q, k, v, attention_mask):
        keep = None if attention_mask is None else attention_mask[:, None, None, :].bool()
        if self.attention == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, is_causal=self.causal,
                                                  enable_gqa=self.kv_heads != self.heads)
        k, v = (t.repeat_interleave(self.heads // self.kv_heads, dim=1) for t in (k, v))
        scores = q @ k.transpose(-2, -1) * self.head_dim ** -0.5
        s = q.shape[2]
        if self.causal:
            scores = scores + torch.full((s, s), float("-inf")).triu(1)
        if keep is not None:
            scores = scores.masked_fill(~keep, float("-inf"))
        return scores.softmax(dim=-1) @ v


def build_case(config: dict):
    """The model and its keyword inputs, the same on every rank: seeded from the configuration."""
    torch.manual_seed(config["seed"])
    if config["model"] == "llama":
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=VOCAB, hidden_size=config["heads"] * config["head_dim"], intermediate_size=32,
            num_hidden_layers=1, num_attention_heads=config["heads"], num_key_value_heads=config["kv_heads"],
            max_position_embeddings=MAX_SEQ, attn_implementation=config["attention"],
        ))
    else:
        model = PlainTransformer(config["heads"], config["kv_heads"], config["head_dim"], config["attention"],
                                 causal=config["mask"] == "causal")
    ids = torch.randint(0, VOCAB, (config["batch"], config["seq"]))
    labels = ids.clone()
    kwargs = {"input_ids": ids, "labels": labels}
    if config["mask"] == "padding":  # transformers-style left padding of the last row
        attention_mask = torch.ones_like(ids)
        attention_mask[-1, : config["padding"]] = 0
        labels[attention_mask == 0] = -100
        kwargs["attention_mask"] = attention_mask
    if config["model"] == "llama":
        kwargs["use_cache"] = False
    return model, kwargs


def loss_and_logits(result) -> dict[str, torch.Tensor]:
    if isinstance(result, tuple):
        logits, loss = result
        return {"loss": loss, "logits": logits}
    return {"loss": result.loss, "logits": result.logits}


def equal_to_eager(rank, pool_size, config):
    """Run ``config`` compiled on the first P ranks of the pool and eagerly on one device, and compare;
    or, where no plan exists (``outcome``), expect a DivisibilityError and nothing else."""
    world_size = config["world_size"]
    group = first_ranks(world_size) if world_size < pool_size else None
    if rank >= world_size:
        return
    model, kwargs = build_case(config)
    reference = copy.deepcopy(model)
    where = f"rank {rank} P={world_size}"
    try:
        if config["zero_stage"]:
            compare_sgd_step(where, model, reference, kwargs, config, group)
        else:
            options = {"compiler": config["compiler"], "group": group}
            compiled = torch.compile(model, backend="ulysses", options=options)
            got = loss_and_logits(compiled(**kwargs))
            got["loss"].backward()
            want = loss_and_logits(reference(**kwargs))
            want["loss"].backward()
            compare_model(rank, model, reference, {name: (got[name], want[name]) for name in want})
    except torch._dynamo.exc.BackendCompilerFailed as failure:
        if outcome(config) == "DivisibilityError" and isinstance(failure.inner_exception, DivisibilityError):
            return
        raise
    assert outcome(config) != "DivisibilityError", f"{where}: no DivisibilityError where no plan exists"


def outcome(config: dict) -> str:
    """What a configuration must give: Ulysses over every rank where the heads allow it; else a ring,
    which runs SDPA over a sequence that splits in blocks of one size; else a DivisibilityError."""
    if config["world_size"] <= config["heads"]:
        return "equal to eager"
    if config["attention"] == "sdpa" and config["seq"] % config["world_size"] == 0:
        return "equal to eager under a ring"
    return "DivisibilityError"


_FIRST_RANKS: dict[int, dist.ProcessGroup] = {}


def first_ranks(world_size: int) -> dist.ProcessGroup:
    """The group of ranks 0 .. P-1 (made once per pool: every rank of the pool must take part)."""
    if world_size not in _FIRST_RANKS:
        _FIRST_RANKS[world_size] = dist.new_group(list(range(world_size)))
    return _FIRST_RANKS[world_size]


def compare_sgd_step(where, model, reference, kwargs, config, group):
    """Gradients of flat shards compared through one SGD step: the loss, the logits and every full
    parameter afterwards, against an eager step."""
    compiled = parallelize(model, zero_stage=config["zero_stage"], group=group, compiler=config["compiler"])
    got = loss_and_logits(compiled(**kwargs))
    got["loss"].backward()
    got["logits"] = got["logits"].clone()  # read before the step: logits a tiled loss left out are computed when read
    torch.optim.SGD(compiled.parameters(), lr=SGD_LR).step()
    want = loss_and_logits(reference(**kwargs))
    want["loss"].backward()
    torch.optim.SGD(reference.parameters(), lr=SGD_LR).step()
    for name in want:
        assert_close(f"{where} {name}", got[name], want[name])
    stepped, want_state = full_state_dict(compiled), reference.state_dict()
    assert sorted(stepped) == sorted(want_state)
    for name, tensor in want_state.items():
        assert_close(f"{where} {name} after an SGD step", stepped[name], tensor)


@st.composite
def configs(draw, world_size: int) -> dict:
    """A configuration for ``world_size`` ranks, as a plain dict: pickled to the ranks, printed on failure."""
    model = draw(st.sampled_from(["llama", "plain"]))
    attention = draw(st.sampled_from(["sdpa", "eager"] if model == "llama" else ["sdpa", "matmul"]))
    # Llama is causal by construction; a bidirectional model is the plain one without a mask.
    mask = draw(st.sampled_from(["causal", "padding"] if model == "llama" else ["causal", "padding", "none"]))
    # Fewer heads than ranks: a ring, or a quick error. A fifth of the draws at most.
    heads = draw(st.integers(1, 8) | st.integers(world_size, 8))
    # Llama's loss shifts labels by one: at least two tokens, or no token is predicted.
    shortest = 2 if model == "llama" else 1
    seq = draw(st.one_of(st.integers(shortest, 2 * world_size), st.integers(shortest, MAX_SEQ)))
    return {
        "world_size": world_size,
        "model": model,
        "attention": attention,
        "mask": mask,
        "heads": heads,
        "kv_heads": draw(st.sampled_from([d for d in range(1, heads + 1) if heads % d == 0])),
        "head_dim": draw(st.sampled_from([2, 4, 8])),
        "batch": draw(st.integers(1, 2)),
        "seq": seq,
        "padding": draw(st.integers(0, seq - 1)) if mask == "padding" else 0,
        "zero_stage": draw(st.sampled_from([0, 0, 1, 2, 3])),
        "compiler": draw(st.sampled_from(["eager"] * 7 + ["aot_eager"])),  # AOTAutograd costs 5-10 s a case
        "seed": draw(st.integers(0, 2**16)),
    }


def check_random_configs(world_size: int, pool_size: int, max_examples: int) -> None:
    """Draw configurations for ``world_size`` ranks and run each on the first ``world_size`` ranks of a
    pool of ``pool_size`` (1: in this process, without a process group)."""
    outcomes = Counter()

    @seed(world_size)
    @settings(max_examples=max_examples * EXAMPLES_SCALE, deadline=None, database=None,
              phases=(Phase.explicit, Phase.generate))
    @given(configs(world_size))
    def random_config_equals_eager(config):
        if pool_size > 1:
            run_ranks(equal_to_eager, pool_size, config)
        else:
            torch.compiler.reset()
            equal_to_eager(0, 1, config)
        outcomes[outcome(config)] += 1

    random_config_equals_eager()
    print(f"\nP={world_size}: {sum(outcomes.values())} random cases, 0 mismatches ({dict(outcomes)})")


def test_random_configs_equal_eager_in_one_process():
    """No process group: the backend compiles as the inner compiler would."""
    assert not dist.is_initialized()
    check_random_configs(1, pool_size=1, max_examples=2)


@pytest.mark.multirank
def test_random_configs_equal_eager_at_P2():
    check_random_configs(2, pool_size=2, max_examples=6)


@pytest.mark.multirank
@pytest.mark.slow
def test_random_configs_equal_eager_at_P3():
    check_random_configs(3, pool_size=4, max_examples=6)


@pytest.mark.multirank
def test_random_configs_equal_eager_at_P4():
    check_random_configs(4, pool_size=4, max_examples=3)


def chain_equal_to_eager(rank, world_size, config):
    from op_probes import chained

    torch.manual_seed(config["seed"])
    model = chained(*config["steps"])
    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(config["seed"])
    ids = torch.randint(0, VOCAB, (2, config["seq"]), generator=generator)
    weights = torch.randn(2, config["seq"], VOCAB, generator=generator)
    compiled = torch.compile(model, backend="ulysses", options={"compiler": config["compiler"]})
    try:
        want = reference(ids)
        (want * weights).sum().backward()
    except RuntimeError as refused:  # autograd refuses the chain in eager (relu_ writing a saved output)
        with pytest.raises(Exception, match="modified by an inplace operation"):
            (compiled(ids) * weights).sum().backward()
        assert "modified by an inplace operation" in str(refused)
        return
    got = compiled(ids)
    (got * weights).sum().backward()
    compare_model(rank, model, reference, {f"{config} output": (got, want)})


@st.composite
def chains(draw) -> dict:
    """Two to four of the op probes' steps in a row after attention, at any length up to 20."""
    from op_probes import STEPS

    return {
        "steps": draw(st.lists(st.sampled_from(sorted(STEPS)), min_size=2, max_size=4)),
        "seq": draw(st.integers(2, 20)),
        "compiler": draw(st.sampled_from(["eager"] * 3 + ["aot_eager"])),
        "seed": draw(st.integers(0, 2**16)),
    }


@pytest.mark.multirank
def test_random_chains_of_probe_ops_equal_eager_at_P2():
    """The op probes' root causes (in-place writes through views, views of written values, gathers of
    written values, partial sums and scans, new buffers) met in random orders, writes and views crossing
    from step to step: each chain's output and every gradient equal eager's. The two examples are
    always run: a write through a view with no sharded form, and a write through a position."""
    @seed(2)
    @settings(max_examples=12 * EXAMPLES_SCALE, deadline=None, database=None, phases=(Phase.explicit, Phase.generate))
    @given(chains())
    @example({"steps": ["strided_alias", "scaled_in_place"], "seq": 15, "compiler": "eager", "seed": 0})
    @example({"steps": ["view_read_after_its_base_is_written", "written_through_a_position"], "seq": 9,
              "compiler": "aot_eager", "seed": 1})
    def chain_equals_eager(config):
        run_ranks(chain_equal_to_eager, 2, config)

    chain_equals_eager()
