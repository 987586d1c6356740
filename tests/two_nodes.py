"""One rank of the two-node test (``tests/test_ring.py``), started by torchrun on each "node": a 4-head
Llama at P = 4 over 2 nodes of 2 ranks, compiled as a user would, against eager on the same inputs."""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist

sys.path[:0] = [os.path.dirname(__file__)]
from graphs import reporting_backend  # noqa: E402
from models import tiny_llama, token_batch  # noqa: E402
from multirank import compare_model  # noqa: E402

if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = tiny_llama(heads=4, kv_heads=4, layers=1)
    reference = copy.deepcopy(model)
    ids, labels = token_batch(seq=64)
    reports = []
    got = torch.compile(model, backend=reporting_backend(reports))(input_ids=ids, labels=labels, use_cache=False)
    got.loss.backward()
    want = reference(input_ids=ids, labels=labels, use_cache=False)
    want.loss.backward()
    sites = [site for report in reports for site in report.attention_sites]
    assert sites and all((site.ulysses, site.ring) == (2, 2) for site in sites), [site.summary() for site in sites]
    assert all(report.head_tail == 2 for report in reports if report.attention_sites), [r.sequence_layout for r in reports]
    kinds = [call.kind for report in reports for call in report.collectives]
    assert kinds.count("ring_attention") == kinds.count("heads_to_seq") == len(sites), kinds
    compare_model(rank, model, reference, {"loss": (got.loss, want.loss), "logits": (got.logits, want.logits)})
    if rank == 0:
        print(sites[0].summary())
    print(f"exact on rank {rank}", flush=True)
    dist.destroy_process_group()
