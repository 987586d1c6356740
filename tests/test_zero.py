"""ZeRO-partitioned parameters (``parallelize``): training against single-device eager step by step at
every stage, with and without sequence parallelism over the same ranks, on a data x sequence mesh;
sharded checkpoints; mixed precision; the gathers in the graphs; the errors for bad use."""

from __future__ import annotations

import copy

import pytest
import torch

from graphs import parallelized_graphs
from models import tiny_gpt2, tiny_llama, token_batch
from multirank import assert_close, run_ranks
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from ulysses_compile import OptionsError, UlyssesError, UnsupportedError, full_state_dict, parallelize
from ulysses_compile.core.sharding import shard_rows


def _step(model, optimizer, batches, replica: int = 0):
    """One training step on this replica's batch; eager models (``replica=None``) average every batch's
    loss, as DDP averages the replicas' gradients."""
    optimizer.zero_grad()
    losses = [model(input_ids=ids, labels=labels, use_cache=False).loss
              for ids, labels in (batches if replica is None else [batches[replica]])]
    (sum(losses) / len(losses)).backward()
    optimizer.step()
    return losses if replica is None else losses[0]


def _train_against_eager(rank, world_size, model, stage, data_parallel=1, optimizer_class=torch.optim.AdamW,
                         steps=3):
    """``steps`` steps of ``model`` parallelized at ``stage`` on a (data_parallel, P / data_parallel)
    mesh (the default group when 1) against eager training with DDP's averaging of the replicas."""
    from torch.distributed.device_mesh import init_device_mesh

    reference = copy.deepcopy(model)
    where = f"rank {rank} P={world_size} stage {stage} dp={data_parallel}"
    mesh = None
    if data_parallel > 1:
        mesh = init_device_mesh("cpu", (data_parallel, world_size // data_parallel), mesh_dim_names=("dp", "sp"))
    compiled = parallelize(model, zero_stage=stage, mesh=mesh, compiler="aot_eager")
    replica = 0 if mesh is None else mesh.get_local_rank("dp")
    optimizer = optimizer_class(compiled.parameters(), lr=1e-2)
    reference_optimizer = optimizer_class(reference.parameters(), lr=1e-2)
    for step in range(steps):
        batches = [token_batch(seq=32, seed=10 * step + seed) for seed in range(1, data_parallel + 1)]
        loss = _step(compiled, optimizer, batches, replica)
        eager_losses = _step(reference, reference_optimizer, batches, replica=None)
        assert_close(f"{where} step {step} loss", loss, eager_losses[replica])
    full = full_state_dict(compiled)
    want = reference.state_dict()
    assert sorted(full) == sorted(want)
    for name, tensor in want.items():
        assert_close(f"{where} {name} after {steps} steps", full[name], tensor)
    for name, param in compiled.named_parameters():
        assert param.shape == reference.get_parameter(name.removeprefix("_orig_mod.")).shape
        if stage > 0:
            assert isinstance(param, DTensor) and param.to_local().shape[0] == shard_rows(
                param.shape[0], world_size, rank)[1], f"{where} {name}: not this rank's rows"


def zero_stages_train_like_eager(rank, world_size):
    """Every stage with sequence parallelism over all ranks, and with data parallelism alone over the
    same ranks (stage 3 with a frozen embedding); at 4 ranks also on a 2 x 2 mesh."""
    for stage in (1, 2, 3):
        _train_against_eager(rank, world_size, tiny_llama(layers=1), stage)
        model = tiny_llama(layers=1)
        if stage == 3:
            model.model.embed_tokens.weight.requires_grad_(False)
        _train_against_eager(rank, world_size, model, stage, data_parallel=world_size)
    if world_size == 4:
        _train_against_eager(rank, world_size, tiny_llama(layers=1), 3, data_parallel=2)


def tied_and_data_parallel_stages(rank, world_size):
    # Tied embedding and lm_head. SGD: GPT-2's key bias has a zero gradient (softmax ignores it), and
    # Adam divides its rounding noise by its own size, so parameters after Adam steps would compare noise.
    _train_against_eager(rank, world_size, tiny_gpt2(layers=1), 2, optimizer_class=torch.optim.SGD)
    # Stage 0 with data parallelism alone: no shards, gradients averaged by the average_grad pass.
    _train_against_eager(rank, world_size, tiny_llama(layers=1), 0, data_parallel=world_size)


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_zero_stages_train_like_eager(world_size):
    """At 4 ranks in the slow tier; the default suite has stages 2 and 3 at 4 ranks in
    test_training_loop.py (clipping, a 2 x 2 mesh) and test_data_streams.py."""
    run_ranks(zero_stages_train_like_eager, world_size)


def inductor_buckets_each_layers_collectives(rank, world_size):
    """ZeRO-3 through Inductor: a layer's parameter all-gathers are one collective (forward, and again
    in the backward; the embedding, the final norm and the LM head are their own), each started before
    the previous one's wait (prefetched one unit ahead, in Inductor's code); the gradients'
    reduce-scatters are bucketed by a layer's size; every attention is parallel (its all-to-alls); loss,
    logits and every gradient equal eager."""
    import re

    from multirank import compare_model
    from ulysses_compile.core.compat import run_and_get_code
    from zero_memory import collective_schedule, overlapped

    layers = 2
    model = tiny_llama(layers=layers)
    reference = copy.deepcopy(model)
    compiled = parallelize(model, zero_stage=3, compiler="inductor")
    ids, labels = token_batch(seq=32)

    def step():
        result = compiled(input_ids=ids, labels=labels, use_cache=False)
        result.loss.backward()
        return result

    got, (forward, backward) = run_and_get_code(step)

    def calls(code, op):
        return len(re.findall(rf"_c10d_functional\.{op}(_out)?\.default\(", code))

    parameters = len(list(model.parameters()))
    gathers, regathers = calls(forward, "all_gather_into_tensor"), calls(backward, "all_gather_into_tensor")
    reductions = calls(backward, "reduce_scatter_tensor")
    assert (gathers, regathers) == (layers + 3, layers + 2) and 2 <= reductions <= layers + 2, (
        f"{parameters} parameters: {gathers} all-gathers, {regathers} in the backward, {reductions} reduce-scatters")
    # each gather starts before the previous one's wait; the gathers in flight while a layer computes
    # span its all-to-alls: every layer's in the forward (the next layer's or the final norm's
    # parameters arrive), every layer's but the last one's in the backward (layer 0 is gathered last)
    for phase, code, count, hidden in (("forward", forward, gathers, 2 * layers),
                                       ("backward", backward, regathers, 2 * (layers - 1))):
        schedule = collective_schedule(code)
        starts = [buffer for event, buffer in schedule if event == "start"]
        order = [(event, buffer) for event, buffer in schedule if event != "all_to_all"]
        prefetched = [("start", starts[0])] + [event for started, waited in zip(starts[1:], starts)
                                               for event in (("start", started), ("wait", waited))]
        assert len(starts) == count and order == prefetched + [("wait", starts[-1])], f"{phase}: {schedule}"
        assert overlapped(schedule) == (count - 1, hidden), f"{phase}: {schedule}"
    # sequence parallel as well: q, k and v to heads in one all-to-all, the output back, each way
    assert [calls(forward, "all_to_all_single"), calls(backward, "all_to_all_single")] == [2 * layers, 2 * layers]
    want = reference(input_ids=ids, labels=labels, use_cache=False)
    want.loss.backward()
    compare_model(rank, model, reference, {"loss": (got.loss, want.loss), "logits": (got.logits, want.logits)})


@pytest.mark.multirank
def test_inductor_buckets_each_layers_zero_collectives():
    run_ranks(inductor_buckets_each_layers_collectives, 2)


@pytest.mark.multirank
def test_tied_weights_and_data_parallel_stage_0_train_like_eager():
    run_ranks(tied_and_data_parallel_stages, 2)


@pytest.mark.multirank
def test_checkpoint_resumes_training_exactly(tmp_path):
    run_ranks(checkpoint_resumes_training_exactly, 2, str(tmp_path))


@pytest.mark.multirank
def test_bf16_parameters_match_eager_autocast():
    run_ranks(bf16_parameters_match_eager_autocast, 2)


@pytest.mark.multirank
def test_checkpoint_loads_at_other_world_sizes(tmp_path):
    run_ranks(checkpoint_loads_at_other_world_sizes, 4, str(tmp_path))


def checkpoint_resumes_training_exactly(rank, world_size, folder):
    """Save with torch.distributed.checkpoint after two steps, train two more; a model built from other
    initial values and an optimizer with another learning rate, loaded from the checkpoint, train those
    two steps to the same bits. The checkpoint holds every parameter whole, each rank writing its part."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    checkpoint_dir = f"{folder}/llama"
    batches = [[token_batch(seq=32, seed=seed)] for seed in (1, 2, 3, 4)]
    model = parallelize(tiny_llama(layers=1), zero_stage=3, compiler="aot_eager")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for batch in batches[:2]:
        _step(model, optimizer, batch)
    saved_state = full_state_dict(model)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=checkpoint_dir)
    losses = [_step(model, optimizer, batch) for batch in batches[2:]]

    resumed = parallelize(tiny_llama(layers=1, seed=7), zero_stage=3, compiler="aot_eager")
    resumed_optimizer = torch.optim.AdamW(resumed.parameters(), lr=5e-2)
    model_state, optimizer_state = get_state_dict(resumed, resumed_optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=checkpoint_dir)
    set_state_dict(resumed, resumed_optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    assert resumed_optimizer.param_groups[0]["lr"] == 1e-2
    resumed_losses = [_step(resumed, resumed_optimizer, batch) for batch in batches[2:]]
    assert [loss.item() for loss in resumed_losses] == [loss.item() for loss in losses]
    final, resumed_final = full_state_dict(model), full_state_dict(resumed)
    for name, tensor in final.items():
        assert torch.equal(resumed_final[name], tensor), f"rank {rank}: {name} differs after resuming"

    if rank == 0:
        whole = f"{folder}/llama.pt"
        dcp_to_torch_save(checkpoint_dir, whole)
        on_disk = torch.load(whole)
        for name, tensor in saved_state.items():
            assert torch.equal(on_disk["model"][name], tensor), name
    dist.barrier()


def checkpoint_loads_at_other_world_sizes(rank, world_size, folder):
    """torch's get_state_dict / torch.distributed.checkpoint / set_state_dict, resharding: a plain-PyTorch
    classifier saved at 4 ranks loads at 2 (stage 3) and at 1 (stage 0), one saved at 2 loads at 4;
    every parameter, AdamW's moments and its step count equal what was saved. Its head's 3-element bias
    is held in rows of 1, 1, 1 and an empty block at 4 ranks, 2 and 1 at 2 ranks."""
    import zlib

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from models import MeanPooledClassifier
    from torch.distributed.tensor import distribute_tensor

    def parallelized(zero_stage, group):
        torch.manual_seed(rank)  # other initial values on every rank, rank 0's broadcast: none is the checkpoint's
        model = parallelize(MeanPooledClassifier(classes=3), zero_stage=zero_stage, group=group,
                            sync_module_states=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model_state, optimizer_state = get_state_dict(model, optimizer)
        return model, optimizer, {"model": model_state, "optimizer": optimizer_state}

    def tensors(state):
        yield from state["model"].items()
        for name, moments in state["optimizer"]["state"].items():
            yield from ((f"{name} {key}", value) for key, value in moments.items())

    def expected(name, value):
        if name.endswith(" step"):
            return torch.tensor(5.0)
        return torch.rand(value.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))

    def fill(state):
        for name, value in tensors(state):
            full = expected(name, value)
            if isinstance(value, DTensor):
                full = distribute_tensor(full, value.device_mesh, value.placements, src_data_rank=None)
            (value.to_local() if isinstance(value, DTensor) else value).copy_(
                full.to_local() if isinstance(full, DTensor) else full)

    def check(model, optimizer, loaded, what):
        """What the model and optimizer hold once ``loaded`` is set into them."""
        set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"])
        model_state, optimizer_state = get_state_dict(model, optimizer)
        for name, value in tensors({"model": model_state, "optimizer": optimizer_state}):
            got = value.full_tensor() if isinstance(value, DTensor) else value
            assert torch.equal(got, expected(name, value)), f"rank {rank}: {name} differs after {what}"

    pairs, alone = dist.new_group([0, 1]), [dist.new_group([r]) for r in range(world_size)]
    model, _, state = parallelized(3, None)
    assert model.head.bias.to_local().numel() == (1 if rank < 3 else 0)
    fill(state)
    dcp.save(state, checkpoint_id=f"{folder}/at4")
    if rank < 3:
        group = pairs if rank < 2 else alone[2]
        zero_stage = 3 if rank < 2 else 0
        model, optimizer, loaded = parallelized(zero_stage, group)
        dcp.load(loaded, checkpoint_id=f"{folder}/at4", process_group=group)
        check(model, optimizer, loaded, f"loading at stage {zero_stage} on {group.size()} rank(s)")
        if rank < 2:
            _, _, at2 = parallelized(3, pairs)
            fill(at2)
            dcp.save(at2, checkpoint_id=f"{folder}/at2", process_group=pairs)
    dist.barrier()
    model, optimizer, loaded = parallelized(3, None)
    dcp.load(loaded, checkpoint_id=f"{folder}/at2")
    check(model, optimizer, loaded, "loading at 4 ranks what 2 saved")


def _full_gradients(model) -> dict[str, torch.Tensor]:
    return {name.removeprefix("_orig_mod."): param.grad.full_tensor() for name, param in model.named_parameters()}


def bf16_parameters_match_eager_autocast(rank, world_size):
    """Shards in fp32, gathered and computed in bf16, gradients reduced in fp32: loss and every
    gradient against eager under bf16 autocast, within bf16 tolerances; fp32 shards and gradients."""
    model = tiny_llama(layers=1)
    reference = copy.deepcopy(model)
    compiled = parallelize(model, zero_stage=3, compiler="aot_eager", param_dtype=torch.bfloat16,
                           reduce_dtype=torch.float32)
    ids, labels = token_batch(seq=32)
    loss = compiled(input_ids=ids, labels=labels, use_cache=False).loss
    loss.backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager_loss = reference(input_ids=ids, labels=labels, use_cache=False).loss
    eager_loss.backward()
    assert loss.dtype == eager_loss.dtype == torch.float32
    assert_close(f"rank {rank} bf16 loss", loss, eager_loss, rtol=BF16_RTOL)

    grads = _full_gradients(compiled)
    assert all(shard.dtype == shard.grad.dtype == torch.float32 for shard in compiled.parameters())
    for name, param in reference.named_parameters():
        assert_close(f"rank {rank} bf16 grad {name}", grads[name], param.grad, rtol=BF16_RTOL)
    fp32 = tiny_llama(layers=1)  # the same initial values
    fp32(input_ids=ids, labels=labels, use_cache=False).loss.backward()
    error = max((grads[name] - param.grad).abs().max() / param.grad.abs().max()
                for name, param in fp32.named_parameters())
    assert error > 1e-3, f"gradients within {error:.1e} of fp32's: were the parameters not gathered in bf16?"


BF16_RTOL = 3e-2  # measured: 1.2e-2 at most (bf16 keeps 8 significant bits; roundings add up)


def _graphs(stage: int, **precision) -> tuple:
    """The forward and backward graphs AOTAutograd makes of a parallelized Llama."""
    ids, labels = token_batch(seq=32)
    parallelized = parallelize(tiny_llama(layers=1), zero_stage=stage, **precision)
    return parallelized_graphs(parallelized, {"input_ids": ids, "labels": labels, "use_cache": False})[1:]


def _collective_dtypes(graph, op) -> list[torch.dtype]:
    """The dtypes of the parameters and gradients that ``op`` calls in ``graph`` communicate for ZeRO:
    those traced from ``gather_parameter``, and the gathers the partitioner re-runs in the backward
    (which carry no purpose)."""
    return [node.args[0].meta["val"].dtype for node in graph.graph.find_nodes(op="call_function", target=op)
            if node.meta.get("custom", {}).get("ulysses_collective", "gather_parameter") == "gather_parameter"]


def test_parameters_are_gathered_inside_the_graph(fake_group):
    from graphs import calls
    from ulysses_compile.core.collectives import gather_parameter, seq_to_heads, seq_to_heads_qkv

    fake_group(2)
    model = tiny_llama(layers=1)
    total = sum(p.numel() for p in model.parameters())
    compiled = parallelize(model, zero_stage=3)
    shards = list(compiled.parameters())
    assert len(shards) == 12 and sum(p.to_local().numel() for p in shards) == total // 2
    ids, labels = token_batch(seq=32)
    gm, _, _ = parallelized_graphs(compiled, {"input_ids": ids, "labels": labels, "use_cache": False})
    assert len(calls(gm, gather_parameter)) == 12
    assert len(calls(gm, seq_to_heads_qkv)) == 1 and calls(gm, seq_to_heads) == []


def test_stage_three_gathers_parameters_again_in_backward(fake_group):
    gather = torch.ops._c10d_functional.all_gather_into_tensor.default
    fake_group(2)
    assert len(_collective_dtypes(_graphs(1)[1], gather)) == 0
    # every parameter but the embedding, whose backward needs only the ids
    assert len(_collective_dtypes(_graphs(3)[1], gather)) == 11


def test_stage_three_under_inductor_with_checkpointing_gathers_every_layer_again(fake_group):
    """Checkpointed layers under Inductor: the backward gathers every layer's parameters again, as
    without checkpointing, so no layer's whole parameters stay alive from the forward to the backward.
    (AOTAutograd's partitioner saves a value tagged for recomputation whose user lies in a later
    checkpointed region: a gather tagged outside the layers' regions stayed whole for every layer, and
    a 24-layer rank held all 24 layers' parameters at its peak.)"""
    import re

    from ulysses_compile.core.compat import run_and_get_code

    fake_group(2)
    layers = 2
    model = tiny_llama(layers=layers)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    compiled = parallelize(model.train(), zero_stage=3, compiler="inductor")
    ids, labels = token_batch(seq=32)
    _, (forward, backward) = run_and_get_code(
        lambda: compiled(input_ids=ids, labels=labels, use_cache=False).loss.backward())
    gathers = [len(re.findall(r"_c10d_functional\.all_gather_into_tensor(_out)?\.default\(", code))
               for code in (forward, backward)]
    assert gathers == [layers + 3, layers + 2], gathers


def test_mixed_precision_gathers_in_bf16_and_reduces_in_the_chosen_dtype(fake_group):
    gather = torch.ops._c10d_functional.all_gather_into_tensor.default
    reduce_scatter = torch.ops._c10d_functional.reduce_scatter_tensor.default
    fake_group(2)
    forward, backward = _graphs(3, param_dtype=torch.bfloat16)
    assert _collective_dtypes(forward, gather) == [torch.bfloat16] * 12
    assert set(_collective_dtypes(backward, gather)) == {torch.bfloat16}
    assert _collective_dtypes(backward, reduce_scatter) == [torch.bfloat16] * 12  # reduce_dtype defaults to it
    _, backward = _graphs(3, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert _collective_dtypes(backward, reduce_scatter) == [torch.float32] * 12


def test_mixed_precision_casts_floating_inputs(fake_group):
    fake_group(2)
    layer = parallelize(torch.nn.Linear(8, 4), zero_stage=3, param_dtype=torch.bfloat16, compiler="eager")
    assert layer(torch.randn(2, 8)).dtype == torch.bfloat16


def test_bad_zero_use_gets_clear_errors(fake_group):
    fake_group(2)
    with pytest.raises(OptionsError, match="zero_stage=4"):
        parallelize(tiny_llama(layers=1), zero_stage=4)
    with pytest.raises(OptionsError, match="param_dtype=torch.int8: expected a floating"):
        parallelize(tiny_llama(layers=1), zero_stage=3, param_dtype=torch.int8)
    with pytest.raises(OptionsError, match="zero_stage=0.*use zero_stage 1-3 on several ranks, or torch.autocast"):
        parallelize(tiny_llama(layers=1), zero_stage=0, param_dtype=torch.bfloat16)
    with pytest.raises(OptionsError, match="unknown ulysses option"):
        parallelize(tiny_llama(layers=1), zero_stage=3, compilr="eager")
    normalized = torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(4, 4))
    with pytest.raises(UnsupportedError, match="Linear already has parametrizations .*remove them first"):
        parallelize(normalized, zero_stage=3)
    model = tiny_llama(layers=1)
    early = torch.optim.AdamW(model.parameters())
    parallelize(model, zero_stage=3)
    with pytest.raises(UlyssesError, match="already parallelized"):
        parallelize(model, zero_stage=3)
    with pytest.raises(UlyssesError, match="build the optimizer after parallelize"):
        early.step()


def test_models_parallelized_in_one_process_share_their_compiled_graph(fake_group):
    """Ten models parallelized one after another in a process (a sweep, a notebook, a test suite) reuse
    one compiled graph per ZeRO setting, so torch's recompile limit (8) never sends one to eager, where
    it would run unsplit."""
    from torch._dynamo.utils import counters

    fake_group(2)
    counters.clear()
    ids, labels = token_batch(seq=32)
    for stage in [3] * 10 + [1]:
        parallelize(tiny_llama(layers=1), zero_stage=stage, compiler="eager")(input_ids=ids, labels=labels,
                                                                            use_cache=False)
    assert counters["stats"]["unique_graphs"] == 2
