"""Registration by name, option checks, and the single-process fallbacks."""

from __future__ import annotations

import importlib.metadata
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import nanogpt
from multirank import assert_close, compare_model
from ulysses_compile import Options, OptionsError


def test_backend_is_registered_by_entry_point():
    names = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="torch_dynamo_backends")}
    assert names.get("ulysses") == "ulysses_compile.entry_point:ulysses"
    assert "ulysses" in torch._dynamo.list_backends(exclude_tags=())


def test_unknown_option_lists_the_valid_ones():
    with pytest.raises(OptionsError) as raised:
        Options.parse({"compiler": "inductor", "sequence_dim": 1})
    message = str(raised.value)
    assert "['sequence_dim']" in message
    for key in ("group", "mesh", "outputs", "compiler", "verify"):
        assert key in message


@pytest.mark.parametrize(
    "options,expected",
    [
        ({"compiler": "tvm"}, "compiler='tvm': expected one of ['inductor', 'aot_eager', 'eager']"),
        ({"outputs": "scatter"}, "outputs='scatter': expected one of ['lazy', 'gather', 'local', 'dtensor']"),
        ({"verify": "yes"}, "verify='yes': expected True, False or 'short'"),
        ({"group": 3}, "expected a torch.distributed.ProcessGroup"),
        ({"rank_wait_warning": 0}, "rank_wait_warning=0: expected seconds (0.001 or more), or None"),
        ({"rank_wait_warning": float("inf")}, "rank_wait_warning=inf: expected seconds"),
        ({"rank_wait_warning": True}, "rank_wait_warning=True: expected seconds"),
    ],
)
def test_wrong_option_values(options, expected):
    with pytest.raises(OptionsError, match=None) as raised:
        Options.parse(options)
    assert expected in str(raised.value)


def test_unknown_option_through_torch_compile(fake_group):
    fake_group(2)
    model, args, kwargs = nanogpt.make(seq_len=8)
    compiled = torch.compile(model, backend="ulysses", options={"outptus": "local"})
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as raised:
        compiled(*args, **kwargs)
    assert isinstance(raised.value.inner_exception, OptionsError)
    assert "['outptus']" in str(raised.value.inner_exception)


def test_one_rank_runs_plainly_with_an_info_line(fake_group, caplog):
    fake_group(1)
    model, args, kwargs = nanogpt.make(seq_len=8)
    want_logits, want_loss = model(*args, **kwargs)
    with caplog.at_level(logging.INFO, logger="ulysses_compile"):
        logits, loss = torch.compile(model, backend="ulysses", options={"compiler": "aot_eager"})(*args, **kwargs)
    assert_close("loss", loss, want_loss)  # AOTAutograd's graph may order the arithmetic otherwise
    assert_close("logits", logits, want_logits)
    lines = [r.getMessage() for r in caplog.records if r.name == "ulysses_compile"]
    assert len(lines) == 1 and "the process group has 1 rank" in lines[0]


def test_one_rank_runs_a_transformers_causal_mask_on_the_causal_kernel(fake_group, caplog):
    """At P = 1 the boolean mask transformers builds from positions becomes ``is_causal=True`` (SDPA's
    faster causal kernel), as at any P; loss and every gradient equal eager."""
    import copy

    from graphs import rewritten_graphs
    from models import tiny_llama, token_batch

    fake_group(1)
    eager = tiny_llama()
    ids, labels = token_batch()
    with caplog.at_level(logging.INFO, logger="ulysses_compile"):
        graph, = rewritten_graphs(copy.deepcopy(eager), (), {"input_ids": ids, "labels": labels, "use_cache": False})
    sdpa = [n for n in graph.graph.nodes if n.target is torch._C._nn.scaled_dot_product_attention]
    assert len(sdpa) == 2 and all(n.kwargs.get("is_causal") and n.kwargs.get("attn_mask") is None for n in sdpa)
    rewritten = [r for r in caplog.records if "its mask is the causal triangle" in r.getMessage()]
    assert len(rewritten) == 2  # the pass rewrote them (transformers passes is_causal itself with a cache)
    compiled_model = copy.deepcopy(eager)
    got = torch.compile(compiled_model, backend="ulysses", options={"compiler": "aot_eager"})(
        input_ids=ids, labels=labels, use_cache=False)
    want = eager(input_ids=ids, labels=labels, use_cache=False)
    got.loss.backward()
    want.loss.backward()
    compare_model(0, compiled_model, eager, {"loss": (got.loss, want.loss), "logits": (got.logits, want.logits)})


def test_by_name_without_import_and_without_process_group(tmp_path):
    """A fresh interpreter that never imports ulysses_compile: the entry point finds the backend, and
    torch.compile enters the backend's context around the calls of its models (not of others)."""
    script = tmp_path / "plain.py"
    script.write_text(textwrap.dedent("""
        import sys
        import torch
        sys.path.insert(0, sys.argv[1])
        import nanogpt
        model, args, kwargs = nanogpt.make(seq_len=8)
        want = model(*args, **kwargs)[1]
        got = torch.compile(model, backend="ulysses", options={"compiler": "aot_eager"})(*args, **kwargs)[1]
        assert "ulysses_compile" in sys.modules, sys.modules.keys()
        assert (got - want).abs().max() <= 1e-4 * want.abs().max(), (got, want)
        # the entry point made torch.compile enter the backend's context around each call, and only then
        seen = []
        class Reading(torch.nn.Module):
            def forward(self, x):
                seen.append(torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint)
                return x + 1
        torch.compile(Reading(), backend="ulysses")(torch.ones(2))
        torch.compile(Reading(), backend="eager")(torch.ones(2))
        assert seen == [True, False] and not torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint, seen
        print("OK")
    """))
    examples = os.path.join(os.path.dirname(__file__), "..", "examples")
    env = {**os.environ, "TORCH_LOGS": "ulysses_compile"}
    done = subprocess.run([sys.executable, str(script), examples], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "OK" in done.stdout
    assert "torch.distributed is not initialized" in done.stderr


def test_mesh_needs_an_sp_dim(fake_group):
    from torch.distributed.device_mesh import init_device_mesh

    fake_group(2)
    with pytest.raises(OptionsError) as raised:
        Options.parse({"mesh": init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))})
    assert "expected a dim named 'sp'" in str(raised.value)


def test_a_tensor_parallel_mesh_dim_is_refused_with_the_reason(fake_group):
    from torch.distributed.device_mesh import init_device_mesh

    fake_group(4)
    with pytest.raises(OptionsError, match=r"'tp' dim is not supported yet. Tensor parallelism splits each "
                                           r"attention's heads .* mesh\['dp', 'sp'\]"):
        Options.parse({"mesh": init_device_mesh("cpu", (2, 2), mesh_dim_names=("sp", "tp"))})


def test_a_mesh_ring_dim_sets_the_ring_and_the_sequence_group(fake_group):
    """("dp", "ring", "sp"): the sequence group is "ring" x "sp" (each "sp" group consecutive in it), the
    ring the "ring" dim's size; an option ring that disagrees, or dims in another order, are refused."""
    from torch.distributed.device_mesh import init_device_mesh

    names = set()
    for rank, sequence_ranks, data_parallel_ranks in [(1, [0, 1, 2, 3], [1, 5]), (6, [4, 5, 6, 7], [2, 6])]:
        fake_group(8, rank=rank)
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "ring", "sp"))
        options = Options.parse({"mesh": mesh})
        assert options.ring == 2 and dist.get_process_group_ranks(options.process_group()) == sequence_ranks
        assert dist.get_process_group_ranks(options.data_parallel_group()) == data_parallel_ranks
        names.add(options.group_name())  # one name for every replica's group: one program
    assert len(names) == 1, names
    with pytest.raises(OptionsError, match="option ring=4 and a mesh whose 'ring' dim has 2 ranks"):
        Options.parse({"mesh": mesh, "ring": 4})
    with pytest.raises(OptionsError, match=r"expected \('sp',\), \('dp', 'sp'\), \('ring', 'sp'\)"):
        Options.parse({"mesh": init_device_mesh("cpu", (2, 4), mesh_dim_names=("sp", "ring"))})


def test_verify_short_needs_a_symbolic_length_and_reports_random_draws(fake_group):
    """``verify="short"`` runs the compiled program at another length, so a graph compiled for one length
    is refused with the fix; a graph that draws random numbers (dropout while training), which the
    compiled program and eager draw differently, runs unchecked with the reason in its report."""
    from ulysses_compile.backend import ulysses

    fake_group(2)
    options = {"compiler": "eager", "verify": "short"}
    model, args, kwargs = nanogpt.make(seq_len=37, n_layer=1)
    with pytest.raises(Exception, match=r"compiled for sequence length 37 only .*dynamic=True"):
        torch.compile(model, backend="ulysses", options=options)(*args, **kwargs)
    torch.compiler.reset()
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return ulysses(gm, example_inputs, options=options)

    model, args, kwargs = nanogpt.make(seq_len=37, n_layer=1, dropout=0.1)
    torch.compile(model, backend=capture, dynamic=True)(*args, **kwargs)
    report = graphs[-1].meta["ulysses_report"]
    assert report.attention_sites and [note for note in report.notes if note.startswith("verify")] == [
        "verify='short' skipped: the graph draws random numbers (dropout p=0.1 at transformer.drop), which the "
        "compiled program and eager draw differently; verify with dropout off (model.eval())"], report.notes

    class CheckpointedDropout(torch.nn.Module):
        def __init__(self):
            super().__init__()
            from op_probes import Attention

            self.attn = Attention()

        def forward(self, x):
            block = lambda h: torch.nn.functional.dropout(self.attn(h), p=0.25, training=True)  # noqa: E731
            return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)

    torch.compiler.reset()
    torch.compile(CheckpointedDropout(), backend=capture, dynamic=True)(torch.randn(2, 37, 16))
    (note,) = graphs[-1].meta["ulysses_report"].notes
    assert note.startswith("verify='short' skipped: the graph draws random numbers (dropout p=0.25 at "), note
