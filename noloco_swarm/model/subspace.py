"""The subspace constraint (`model.subspace_rank = k`): U and F from the run seed, and the layers
that keep every write into the residual stream in span(U).

U (d x k, orthonormal columns) and F (V x d, a frozen token table) are drawn on the CPU in fp32 from
generators seeded by the run seed alone, so every peer and replica derives the same bits whatever
its stage or device. A stage before the last reparametrises its writes into the residual as U times
a trainable factor, as PluralisResearch/agora (`models/reparam_llama/components.py`) and
ProtocolNanoGPT (`train_gpt_ssn.py`) do:

  embedding             x0 = E_k[t] U^T + F[t]   (E_k: V x k, trains; F frozen)
  attention o_proj      W = U A                  (A: k x d trains)
  MLP down_proj         W = U A                  (A: k x intermediate trains)

so its residual is F[t] + U c by construction, under any optimiser, weight decay or outer step:
whatever the outer step averages is A, and U A stays in span(U). The last stage (its layers, final
norm and untied head) is unconstrained: its output never crosses a boundary. The factors are plain
`nn.Linear` / `nn.Embedding` modules (`<name>.factor.weight`), initialised N(0, init_std) like
any weight (stage.py), which is the distribution of U^T W for a dense W so initialised.

U and F are drawn once per process and run (cached) and shared, not copied, by every CPU module
and wire codec of that run: the simulator's N first-stage replicas and a peer's codec hold one F
between them (V x d floats: 1 GB for medium), and a stage without the embedding draws none.

Known limits: U never changes during training (the paper mentions periodic Grassmann updates; no
code for them was found), and F costs V x d floats on every peer that encodes or decodes rows.
"""

from __future__ import annotations

import functools
import hashlib

import torch
import torch.nn.functional as F
from torch import nn

from noloco_swarm.model.presets import ModelConfig
from noloco_swarm.protocol.subspace import Subspace


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"noloco-subspace/{seed}/{name}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def make_basis(cfg: ModelConfig, seed: int) -> torch.Tensor:
    """U: (hidden, k) float32 with orthonormal columns, from the run seed (a fresh tensor).

    A Gaussian draw orthonormalised by QR in float64 (signs fixed so that R's diagonal is positive,
    which makes the factor unique), then rounded to float32: the float64 step keeps the columns
    orthonormal to float32's precision."""
    return _draw_basis(cfg.hidden_size, cfg.subspace_rank, seed)


def make_table(cfg: ModelConfig, seed: int) -> torch.Tensor:
    """F: (vocab, hidden) float32 ~ N(0, init_std), the frozen part of every token's embedding (a
    fresh tensor)."""
    return _draw_table(cfg.vocab_size, cfg.hidden_size, cfg.init_std, seed)


def _draw_basis(d: int, k: int, seed: int) -> torch.Tensor:
    if not 0 < k <= d:
        raise ValueError(f"model.subspace_rank must be within 1..{d} for a basis, got {k}")
    draw = torch.empty(d, k, dtype=torch.float32).normal_(generator=_generator(seed, "basis"))
    q, r = torch.linalg.qr(draw.double())
    return (q * torch.sign(torch.diagonal(r))).to(torch.float32).contiguous()


def _draw_table(vocab: int, hidden: int, init_std: float, seed: int) -> torch.Tensor:
    table = torch.empty(vocab, hidden, dtype=torch.float32)
    return table.normal_(0.0, init_std, generator=_generator(seed, "table"))


# Drawn once per process and shared by their callers, who only read them. A process holds one run
# (the simulator runs its seeds one after another): the last F drawn is kept, and a few U.
_shared_basis = functools.lru_cache(maxsize=4)(_draw_basis)
_shared_table = functools.lru_cache(maxsize=1)(_draw_table)


def shared_basis(cfg: ModelConfig, seed: int) -> torch.Tensor:
    """The run's U, shared (see make_basis)."""
    return _shared_basis(cfg.hidden_size, cfg.subspace_rank, seed)


def shared_table(cfg: ModelConfig, seed: int) -> torch.Tensor:
    """The run's F, shared (see make_table)."""
    return _shared_table(cfg.vocab_size, cfg.hidden_size, cfg.init_std, seed)


def make_subspace(cfg: ModelConfig, seed: int) -> Subspace:
    """The run's U and F (what the subspace wire format needs), on the CPU, shared."""
    return Subspace(basis=shared_basis(cfg, seed), table=shared_table(cfg, seed))


def _in_span(h: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """h U^T in float32 with autocast off: a bf16 product would round the write off span(U)."""
    with torch.autocast(h.device.type, enabled=False):
        return F.linear(h.to(torch.float32), basis)


class SpanLinear(nn.Module):
    """A linear map into the residual stream, W = U A (out = hidden): only A (`factor`) trains."""

    def __init__(self, in_features: int, hidden: int, rank: int) -> None:
        super().__init__()
        self.factor = nn.Linear(in_features, rank, bias=False)
        self.register_buffer("basis", torch.empty(hidden, rank), persistent=False)

    def effective_weight(self) -> torch.Tensor:
        """W = U A, (hidden, in_features)."""
        return self.basis @ self.factor.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _in_span(self.factor(x), self.basis)


class SpanEmbedding(nn.Module):
    """The input embedding E_k[t] U^T + F[t]: only E_k (`factor`, vocab x k) trains."""

    def __init__(self, vocab: int, hidden: int, rank: int) -> None:
        super().__init__()
        self.factor = nn.Embedding(vocab, rank)
        self.register_buffer("basis", torch.empty(hidden, rank), persistent=False)
        self.register_buffer("table", torch.empty(vocab, hidden), persistent=False)

    def effective_weight(self) -> torch.Tensor:
        """The learnable part E_k U^T, (vocab, hidden)."""
        return self.factor.weight @ self.basis.T

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return _in_span(self.factor(ids), self.basis) + self.table[ids]


@torch.no_grad()
def load_subspace_(module: nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Point the basis (and table) buffers of every constrained layer in `module` at the run's U
    and F (make_subspace's shared tensors; moving the module to another device copies them)."""
    spans = [m for m in module.modules() if isinstance(m, SpanLinear | SpanEmbedding)]
    if not spans:
        return
    basis = shared_basis(cfg, seed)
    for m in spans:
        if m.basis.shape != basis.shape:
            raise ValueError(f"a layer's basis is {tuple(m.basis.shape)}, the run's U {tuple(basis.shape)}")
        m.basis = basis
        if isinstance(m, SpanEmbedding):  # only the first stage: F is drawn for it alone
            m.table = shared_table(cfg, seed)
