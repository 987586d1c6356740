"""nanoGPT with a top-k mixture-of-experts MLP in plain PyTorch, written the usual way (nothing here knows
about ulysses): a router, top-k gates renormalized, experts as stacked weights, a load-balancing loss
(Switch Transformer's: experts times the dot product of the token fraction and the mean router
probability per expert) and a router z-loss.

Two ways to dispatch, as people write them:

- ``sorted``: sort the (token, slot) pairs by expert, read each pair's token and its expert's weights,
  and add the results back at their tokens with ``index_add_``;
- ``dense``: every expert on every token, weighted by a gate that is zero off the top-k (small models);
- ``split``: torchtitan's loop over experts: count the tokens per expert (``histc``), read the counts
  with ``.tolist()`` (a graph break) and ``torch.split`` the sorted rows by them.

``make()`` returns ``(model, args, kwargs)`` for ``python -m ulysses_compile``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import nanogpt


@dataclass
class MoEConfig(nanogpt.GPTConfig):
    n_expert: int = 4
    top_k: int = 2
    dispatch: str = "sorted"
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001


class MoE(nn.Module):
    def __init__(self, config: MoEConfig):
        super().__init__()
        self.top_k, self.n_expert, self.dispatch = config.top_k, config.n_expert, config.dispatch
        hidden = 4 * config.n_embd
        self.router = nn.Linear(config.n_embd, config.n_expert, bias=False)
        self.w_in = nn.Parameter(torch.randn(config.n_expert, config.n_embd, hidden) * 0.02)
        self.w_out = nn.Parameter(torch.randn(config.n_expert, hidden, config.n_embd) * 0.02)
        self.aux_loss = self.z_loss = None

    def forward(self, x):
        B, T, C = x.shape
        x = x.reshape(-1, C)
        logits = self.router(x)
        probs = logits.softmax(dim=-1)
        gates, experts = probs.topk(self.top_k, dim=-1)
        gates = gates / gates.sum(dim=-1, keepdim=True)
        chosen = F.one_hot(experts, self.n_expert).float().sum(dim=1)
        self.aux_loss = self.n_expert * (chosen.mean(dim=0) / self.top_k * probs.mean(dim=0)).sum()
        self.z_loss = torch.logsumexp(logits, dim=-1).pow(2).mean()
        if self.dispatch == "dense":
            weights = torch.zeros_like(probs).scatter(1, experts, gates)
            hidden = F.gelu(torch.einsum("tc,ech->teh", x, self.w_in))
            out = torch.einsum("teh,ehc,te->tc", hidden, self.w_out, weights)
        elif self.dispatch == "split":
            flat_experts = experts.reshape(-1)
            counts = torch.histc(flat_experts.float(), bins=self.n_expert, min=0, max=self.n_expert).long()
            order = flat_experts.argsort(stable=True)
            tokens = order // self.top_k
            chunks = torch.split(x[tokens], counts.tolist())
            y = torch.cat([F.gelu(chunk @ self.w_in[e]) @ self.w_out[e] for e, chunk in enumerate(chunks)])
            out = torch.zeros_like(x).index_add_(0, tokens, y * gates.reshape(-1)[order].unsqueeze(-1))
        else:
            flat_experts = experts.reshape(-1)
            order = flat_experts.argsort()
            tokens = order // self.top_k
            rows = x[tokens]
            sorted_experts = flat_experts[order]
            hidden = F.gelu(torch.bmm(rows.unsqueeze(1), self.w_in[sorted_experts]))
            y = torch.bmm(hidden, self.w_out[sorted_experts]).squeeze(1)
            out = torch.zeros_like(x).index_add_(0, tokens, y * gates.reshape(-1)[order].unsqueeze(-1))
        return out.reshape(B, T, C)


class Block(nanogpt.Block):
    def __init__(self, config: MoEConfig):
        super().__init__(config)
        self.mlp = MoE(config)


class MoEGPT(nanogpt.GPT):
    def __init__(self, config: MoEConfig):
        super().__init__(config)
        self.transformer.h = nn.ModuleList([Block(config) for _ in range(config.n_layer)])

    def forward(self, idx, targets=None):
        logits, loss = super().forward(idx, targets)
        if loss is not None:
            moe = [block.mlp for block in self.transformer.h]
            loss = loss + self.config.aux_loss_coef * sum(m.aux_loss for m in moe) / len(moe) \
                + self.config.z_loss_coef * sum(m.z_loss for m in moe) / len(moe)
        return logits, loss


def make(seq_len: int = 64, batch: int = 2, seed: int = 0, **config):
    """FACTORY: a tiny MoE GPT, token ids and next-token targets."""
    torch.manual_seed(seed)
    model = MoEGPT(MoEConfig(**config))
    data = torch.randint(0, model.config.vocab_size, (batch, seq_len + 1))
    return model, (data[:, :-1].contiguous(),), {"targets": data[:, 1:].contiguous()}
