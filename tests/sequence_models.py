"""Models written the ways that stress the sequence dim: sequence-first layouts and graph breaks."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import nanogpt

VOCAB, DIM, HEADS = 128, 64, 4


class SequenceFirst(nn.Module):
    """Megatron-style: token ids arrive ``[S, B]``, activations are ``[S, B, H]`` throughout, attention
    permutes to ``[B, heads, S, D]`` and back, the loss flattens ``[S*B, V]``."""

    def __init__(self, layers: int = 2):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, DIM)
        self.qkv = nn.ModuleList(nn.Linear(DIM, 3 * DIM) for _ in range(layers))
        self.proj = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(layers))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids, labels):
        seq, batch = ids.shape
        x = self.embedding(ids)  # [S, B, H]
        for qkv, proj in zip(self.qkv, self.proj):
            q, k, v = qkv(x).view(seq, batch, 3, HEADS, DIM // HEADS).permute(2, 1, 3, 0, 4)
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + proj(attended.permute(2, 0, 1, 3).reshape(seq, batch, DIM))
        logits = self.head(self.norm(x))
        loss = F.cross_entropy(logits.view(-1, VOCAB), labels.reshape(-1))
        return logits, loss


class GraphBreakGPT(nanogpt.GPT):
    """nanoGPT (two blocks) whose forward breaks the Dynamo graph between the blocks and before the head
    (a print, an .item() or a data-dependent branch would do the same)."""

    def forward(self, idx, targets=None):
        b, t = idx.size()
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(t, device=idx.device))
        first, second = self.transformer.h
        x = first(x)
        torch._dynamo.graph_break()
        x = second(x)
        torch._dynamo.graph_break()
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


class BreakAround(nanogpt.GPT):
    """nanoGPT with a graph break where a test puts it: ``"after_loss"`` between the loss and the return
    (the logits cross the break), ``"write"`` before the second block, which then writes its input in
    place."""

    where = "after_loss"

    def forward(self, idx, targets=None):
        b, t = idx.size()
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(t, device=idx.device))
        first, second = self.transformer.h
        x = first(x)
        if self.where == "write":
            torch._dynamo.graph_break()
            x.mul_(2)
        x = second(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        if self.where == "after_loss":
            torch._dynamo.graph_break()
        return logits, loss


def break_around(where: str, seq: int = 32, seed: int = 0):
    model, args, kwargs = nanogpt.make(seq_len=seq, seed=seed)
    broken = BreakAround(model.config)
    broken.load_state_dict(model.state_dict())
    broken.where = where
    return broken, args, kwargs


class BreakingBlock(nanogpt.Block):
    """A block whose code breaks the graph between its attention and its MLP: Dynamo compiles the code
    before the break once, then runs that one graph for every layer."""

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        torch._dynamo.graph_break()
        return x + self.mlp(self.ln_2(x))


def break_in_every_block(seq: int = 32, layers: int = 3, seed: int = 0):
    model, args, kwargs = nanogpt.make(seq_len=seq, seed=seed, n_layer=layers)
    for index, block in enumerate(model.transformer.h):
        breaking = BreakingBlock(model.config)
        breaking.load_state_dict(block.state_dict())
        model.transformer.h[index] = breaking
    return model, args, kwargs


def sequence_first(seq: int = 32, batch: int = 2, seed: int = 0):
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, VOCAB, (seq, batch), generator=generator)
    return SequenceFirst(), (ids, ids.roll(-1, dims=0)), {}


def graph_break_gpt(seq: int = 32, seed: int = 0):
    model, args, kwargs = nanogpt.make(seq_len=seq, seed=seed)
    broken = GraphBreakGPT(model.config)
    broken.load_state_dict(model.state_dict())
    return broken, args, kwargs
