"""Llama 3 decoder in plain torch, shaped by a :class:`LlamaShape`.

Structure (and therefore FSDP unit names) follows torchtitan's Llama 3:
``tok_embeddings``, ``layers.<i>`` (attention + SwiGLU feed-forward), ``norm``, ``output``.
Big shapes are built on the meta device (``device="meta"``) to count parameters or plan
without allocating.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from profiles.chunked_init import ShardCache, count_chunks, draw_rows, get_local_rows


@dataclass(kw_only=True, frozen=True, slots=True)
class LlamaShape:
    """Architecture hyper-parameters (as in Meta's published ``params.json``)."""

    dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_dim: int
    vocab_size: int
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    max_seq_len: int = 8192

    def __post_init__(self) -> None:
        for name in ("dim", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_dim", "vocab_size", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if self.dim % self.num_heads:
            raise ValueError(f"dim {self.dim} is not divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    def get_num_params(self) -> int:
        """Exact parameter count, computed without building the model."""
        kv_dim = self.num_kv_heads * self.head_dim
        attn = self.dim * self.dim * 2 + self.dim * kv_dim * 2
        ffn = 3 * self.dim * self.ffn_hidden_dim
        block = attn + ffn + 2 * self.dim
        embed = self.vocab_size * self.dim
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return embed + self.num_layers * block + self.dim + head


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def _rope_tables(
    head_dim: int, seq_len: int, theta: float, device: torch.device | None
) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (batch, seq, heads, head_dim); rotate interleaved pairs.
    x_pairs = x.float().unflatten(-1, (-1, 2))
    real, imag = x_pairs[..., 0], x_pairs[..., 1]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.num_heads = shape.num_heads
        self.num_kv_heads = shape.num_kv_heads
        self.head_dim = shape.head_dim
        self.wq = nn.Linear(shape.dim, shape.num_heads * shape.head_dim, bias=False)
        self.wk = nn.Linear(shape.dim, shape.num_kv_heads * shape.head_dim, bias=False)
        self.wv = nn.Linear(shape.dim, shape.num_kv_heads * shape.head_dim, bias=False)
        self.wo = nn.Linear(shape.num_heads * shape.head_dim, shape.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = self.wq(x).view(bsz, seq, self.num_heads, self.head_dim)
        k = self.wk(x).view(bsz, seq, self.num_kv_heads, self.head_dim)
        v = self.wv(x).view(bsz, seq, self.num_kv_heads, self.head_dim)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        repeats = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(repeats, dim=2)
        v = v.repeat_interleave(repeats, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(shape.dim, shape.norm_eps)
        self.attention = Attention(shape)
        self.ffn_norm = RMSNorm(shape.dim, shape.norm_eps)
        self.feed_forward = FeedForward(shape.dim, shape.ffn_hidden_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


def get_init_identity(shape: LlamaShape, seed: int) -> tuple:
    """What :meth:`Llama.init_weights`'s values depend on: the model a shard cache holds ([Note: shard cache])."""
    return ("llama", shape, seed)


class Llama(nn.Module):
    """Llama 3 decoder; ``forward(tokens) -> logits``."""

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.shape = shape
        self.tok_embeddings = nn.Embedding(shape.vocab_size, shape.dim)
        self.layers = nn.ModuleList(TransformerBlock(shape) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.dim, shape.norm_eps)
        self.output = nn.Linear(shape.dim, shape.vocab_size, bias=False)
        if shape.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def init_weights(self, seed: int, *, cache: ShardCache | None = None) -> int:
        """Deterministic init, identical on every rank and every mesh for the same seed: norm
        weights 1, the rest ``N(0, 0.02^2)`` (``wo``/``w2`` scaled by ``1 / sqrt(2 * layers)``),
        drawn in row chunks with a generator each ([Note: chunked init] in
        :mod:`profiles.chunked_init`). Parameters already sharded (DTensors: a model built on the
        meta device, sharded, then materialised with ``to_empty``) get their own rows of the very
        values a full build has, drawing only the chunks that overlap them (no communication).
        ``cache``: rows an earlier build of this model (shape and seed) drew here are restored from
        it, the others drawn and kept there ([Note: shard cache]; its ``counts`` say which).
        Returns how many random numbers this rank drew."""
        from torch.distributed.tensor import DTensor

        std = 0.02
        weights = [(n, p, get_local_rows(p)) for n, p in self.named_parameters() if not n.endswith("norm.weight")]
        if cache is not None:  # its bound follows this build's shard: fp32 bytes of its drawn rows
            shard = sum(4 * (stop - start) * math.prod(p.shape[1:]) for _, p, (start, stop) in weights)
            cache.start_build(get_init_identity(self.shape, seed), shard)
        chunk, drawn = 0, 0
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
            for index, (name, param, rows) in enumerate(weights):
                scale = std / math.sqrt(2 * self.shape.num_layers) if name.endswith(("wo.weight", "w2.weight")) else std
                local = param.to_local() if isinstance(param, DTensor) else param  # aliases the parameter
                if cache is not None:
                    n = cache.fill(local, param.shape, rows, index=index, seed=seed, first_chunk=chunk, scale=scale)
                else:
                    # drawn straight into a host fp32 shard; elsewhere (a GPU) on the host, then copied
                    direct = local.device.type == "cpu" and local.dtype == torch.float32 and local.is_contiguous()
                    values, n = draw_rows(
                        param.shape, rows, seed=seed, first_chunk=chunk, scale=scale, out=local if direct else None
                    )
                    if not direct:
                        local.copy_(values)
                chunk, drawn = chunk + count_chunks(param.shape), drawn + n
        return drawn

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        cos, sin = _rope_tables(self.shape.head_dim, tokens.shape[1], self.shape.rope_theta, tokens.device)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))
