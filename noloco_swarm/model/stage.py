"""One pipeline stage of the Llama-style decoder, built from transformers' Llama modules."""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import (
    LlamaConfig,
    LlamaDecoderLayer,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from noloco_swarm.model.presets import ModelConfig
from noloco_swarm.model.split import split_layers, stage_layers
from noloco_swarm.model.subspace import SpanEmbedding, SpanLinear, load_subspace_

# Target value that contributes no loss (PyTorch's default); lets the data side mask padding.
IGNORE_INDEX: int = -100


def to_llama_config(cfg: ModelConfig) -> LlamaConfig:
    """The transformers `LlamaConfig` for our shape: MHA (no GQA), no biases, SwiGLU, untied head."""
    hf = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        max_position_embeddings=cfg.seq_len,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        attn_implementation=cfg.attn_implementation,
    )
    # The attention modules read the backend from this private field on every call.
    hf._attn_implementation = cfg.attn_implementation
    return hf


def derive_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed for one named parameter, independent of how the model is split."""
    digest = hashlib.sha256(f"noloco-init/{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def init_parameters_(module: nn.Module, seed: int, std: float) -> None:
    """Fill every parameter from its own generator seeded by (seed, global parameter name).

    Linear and embedding weights ~ N(0, std), RMSNorm weights = 1 (as the official code). Keying the
    draw on the global name, not on construction order, is what makes stage s built alone equal
    to the same layers of the unsplit model, and every replica with the same seed identical.
    The global torch RNG is never touched. Draws happen on the CPU so that every device gets the
    same numbers; move the module afterwards.
    """
    done: set[str] = set()
    for prefix, sub in module.named_modules():
        if isinstance(sub, (nn.Linear, nn.Embedding)):
            name = f"{prefix}.weight"
            gen = torch.Generator(device="cpu").manual_seed(derive_seed(seed, name))
            cpu = torch.empty(sub.weight.shape, dtype=torch.float32)
            cpu.normal_(0.0, std, generator=gen)
            sub.weight.copy_(cpu)
            done.add(name)
        elif isinstance(sub, LlamaRMSNorm):
            sub.weight.fill_(1.0)
            done.add(f"{prefix}.weight")
    missed = [n for n, _ in module.named_parameters() if n not in done]
    if missed:
        # A parameter with no init rule would keep whatever memory `to_empty` left behind.
        raise RuntimeError(f"no init rule for parameters {missed}; extend init_parameters_.")


def causal_mask(seq_len: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive mask (1, 1, T, T): 0 on and below the diagonal, the dtype's minimum above it."""
    full = torch.full((seq_len, seq_len), torch.finfo(dtype).min, dtype=dtype, device=device)
    return full.triu(1)[None, None]


def per_sample_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of each sample, shape (B,); `IGNORE_INDEX` targets do not count."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        # Softmax over a 128k vocabulary loses too much in half precision.
        logits = logits.float()
    tokens = F.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), reduction="none", ignore_index=IGNORE_INDEX
    ).view(targets.shape)
    counts = (targets != IGNORE_INDEX).sum(dim=1).clamp_min(1)
    return tokens.sum(dim=1) / counts


class Stage(nn.Module):
    """Layers `layer_range` of the decoder; stage 0 adds the embedding, the last the norm and head.

    Forward contract, `stage(x, targets=None)`:
      - first stage: `x` is input ids, LongTensor (B, T); other stages: hidden states, float (B, T, hidden).
      - non-last stage: returns hidden states (B, T, hidden).
      - last stage: with `targets` (LongTensor (B, T), already shifted: `targets[:, t]` is the token
        after position t) returns the per-sample mean token cross-entropy, shape (B,); the caller
        divides by the batch size, as the official code does. Without targets it returns logits
        (B, T, vocab) in the weights' dtype.
    A single stage (num_stages == 1) does both ends. Parameter names are global
    (`layers.<global index>.…`, `embed_tokens.weight`, `norm.weight`, `lm_head.weight`), so the
    same parameter has the same name under every split.

    Samples are dense: there is no padding mask and positions are 0..T-1 in every sample.

    With `cfg.subspace_rank` k > 0, a stage other than the last writes into the residual only
    within F[t] + span(U) (model/subspace.py): its embedding is `embed_tokens.factor.weight` and
    its output and down projections `….o_proj.factor.weight`, `….down_proj.factor.weight`.
    """

    embed_tokens: nn.Embedding | SpanEmbedding | None
    norm: LlamaRMSNorm | None
    lm_head: nn.Linear | None

    def __init__(self, cfg: ModelConfig, stage: int, num_stages: int, seed: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.stage = stage
        self.num_stages = num_stages
        self.layer_range = stage_layers(cfg.num_layers, stage, num_stages)
        self.is_first = stage == 0
        self.is_last = stage == num_stages - 1
        # Only a stage whose output crosses a boundary is constrained (model/subspace.py).
        self.subspace_rank = cfg.subspace_rank if not self.is_last else 0
        hf = to_llama_config(cfg)
        # Build on the meta device: the default nn.Linear init would draw from (and advance)
        # the global RNG and cost time on large models; init_parameters_ overwrites it all anyway.
        with torch.device("meta"):
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if self.is_first else None
            self.layers = nn.ModuleDict(
                {str(i): LlamaDecoderLayer(hf, layer_idx=i) for i in self.layer_range}
            )
            self.norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps) if self.is_last else None
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if self.is_last else None
            if self.subspace_rank:
                self._constrain(cfg)
        self.to_empty(device="cpu")
        load_subspace_(self, cfg, seed)
        # Built after to_empty: its inv_freq buffer is computed at construction, not a parameter.
        self.rotary_emb = LlamaRotaryEmbedding(config=hf)
        init_parameters_(self, seed, cfg.init_std)

    def _constrain(self, cfg: ModelConfig) -> None:
        """Replace every write into the residual with its subspace form, W = U A (on meta)."""
        d, f, k = cfg.hidden_size, cfg.intermediate_size, self.subspace_rank
        if self.embed_tokens is not None:
            self.embed_tokens = SpanEmbedding(cfg.vocab_size, d, k)
        for layer in self.layers.values():
            layer.self_attn.o_proj = SpanLinear(d, d, k)
            layer.mlp.down_proj = SpanLinear(f, d, k)

    def extra_repr(self) -> str:
        return f"stage={self.stage}/{self.num_stages}, layers={self.layer_range.start}..{self.layer_range.stop - 1}"

    def _check_input(self, x: torch.Tensor, targets: torch.Tensor | None) -> None:
        # Inputs may come off the network: fail with a message, not deep inside attention
        # (or, on CUDA, with a device-side assert that kills the process).
        if self.is_first:
            if x.dtype != torch.long or x.dim() != 2:
                raise ValueError(
                    f"stage 0 expects input ids LongTensor (B, T), got {x.dtype} {tuple(x.shape)}"
                )
            if x.numel() and (int(x.min()) < 0 or int(x.max()) >= self.cfg.vocab_size):
                raise ValueError(f"input ids must lie in [0, {self.cfg.vocab_size})")
        elif not x.is_floating_point() or x.dim() != 3 or x.shape[-1] != self.cfg.hidden_size:
            raise ValueError(
                f"stage {self.stage} expects hidden states float (B, T, {self.cfg.hidden_size}), "
                f"got {x.dtype} {tuple(x.shape)}"
            )
        if targets is None:
            return
        if not self.is_last:
            raise ValueError(f"stage {self.stage} is not the last stage; only the last stage takes targets")
        if targets.dtype != torch.long or tuple(targets.shape) != tuple(x.shape[:2]):
            raise ValueError(
                f"targets must be LongTensor {tuple(x.shape[:2])}, got {targets.dtype} {tuple(targets.shape)}"
            )
        valid = targets[targets != IGNORE_INDEX]
        if valid.numel() and (int(valid.min()) < 0 or int(valid.max()) >= self.cfg.vocab_size):
            raise ValueError(f"targets must lie in [0, {self.cfg.vocab_size}) or equal {IGNORE_INDEX}")

    def _attention_kwargs(self, hidden: torch.Tensor) -> dict[str, object]:
        # The official code passes no mask, so eager attention there is bidirectional. Eager
        # needs an explicit additive mask; SDPA gets is_causal=True with no mask, which keeps
        # it on the flash / memory-efficient kernels (an explicit mask would rule those out).
        if self.cfg.attn_implementation == "eager":
            mask = causal_mask(hidden.shape[1], hidden.dtype, hidden.device)
            return {"attention_mask": mask, "is_causal": True}
        return {"attention_mask": None, "is_causal": True}

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        self._check_input(x, targets)
        # Master weights stay fp32; autocast only lowers the matmuls. The residual stream stays
        # in the input's dtype because each layer adds its bf16 output onto an fp32 residual.
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=self.cfg.autocast_bf16):
            hidden = self.embed_tokens(x) if self.embed_tokens is not None else x
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
            position_embeddings = self.rotary_emb(hidden, position_ids)
            attn_kwargs = self._attention_kwargs(hidden)
            for layer in self.layers.values():
                hidden = layer(
                    hidden, position_embeddings=position_embeddings, position_ids=position_ids, **attn_kwargs
                )
            if self.lm_head is None or self.norm is None:
                return hidden
            logits = self.lm_head(self.norm(hidden))
        if targets is None:
            return logits.to(self.lm_head.weight.dtype)
        return per_sample_loss(logits, targets)


def build_stage(cfg: ModelConfig, stage: int, num_stages: int, seed: int) -> Stage:
    """Stage `stage` of `num_stages`, initialised from `seed` exactly as in the unsplit model (on CPU)."""
    return Stage(cfg, stage, num_stages, seed)


def build_model(cfg: ModelConfig, seed: int) -> Stage:
    """The unsplit model: one stage holding the embedding, every layer, the norm and the head."""
    return Stage(cfg, 0, 1, seed)


def build_stages(cfg: ModelConfig, num_stages: int, seed: int) -> list[Stage]:
    """All stages of one replica, in pipeline order; chaining them equals `build_model`."""
    split_layers(cfg.num_layers, num_stages)  # validate once, before building anything
    return [Stage(cfg, s, num_stages, seed) for s in range(num_stages)]
