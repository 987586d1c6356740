import pytest
import torch
import torch.distributed as dist


@pytest.fixture
def fake_group():
    """A one-process "fake" process group at a chosen world size: collectives are shape-only."""
    from ulysses_compile.core.compat import register_fake_backend

    register_fake_backend()

    def init(world_size: int, rank: int = 0):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world_size)
        return dist.group.WORLD

    torch.compiler.reset()
    yield init
    if dist.is_initialized():
        dist.destroy_process_group()
    torch.compiler.reset()
