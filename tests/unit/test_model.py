"""Unit tests for noloco_swarm.model: split, presets, init, causality, gradients, state helpers."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import LlamaForCausalLM

from noloco_swarm.model import (
    IGNORE_INDEX,
    PRESETS,
    ModelConfig,
    Stage,
    build_model,
    build_stage,
    build_stages,
    count_parameters,
    count_stage_parameters,
    flat_params,
    get_preset,
    load_flat_params_,
    num_flat,
    split_layers,
    state_hash,
)
from noloco_swarm.model.presets import SCHEDULES
from noloco_swarm.model.stage import to_llama_config

SEED = 1234
# Short sequences keep every forward well under a second on two shared CPU cores.
T = 16


@pytest.fixture(autouse=True, scope="module")
def _few_threads() -> Iterator[None]:
    # The test machine has two shared cores; more threads only add contention.
    before = torch.get_num_threads()
    torch.set_num_threads(min(before, 2))
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny() -> ModelConfig:
    return get_preset("tiny")


def _ids(cfg: ModelConfig, batch: int = 2, seq: int = T, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)


def _run_pipeline(stages: list[Stage], ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Forward and backward through the stages as the swarm does: detach at each hop, send grads back."""
    inputs: list[torch.Tensor] = []
    outputs: list[torch.Tensor] = []
    x: torch.Tensor = ids
    for stage in stages[:-1]:
        out = stage(x)
        outputs.append(out)
        x = out.detach().requires_grad_(True)
        inputs.append(x)
    per_sample = stages[-1](x, targets)
    loss = per_sample.sum() / per_sample.shape[0]
    loss.backward()
    for out, inp in zip(reversed(outputs), reversed(inputs), strict=True):
        assert inp.grad is not None
        out.backward(inp.grad)
    return loss.detach()


# --- split -------------------------------------------------------------------------------------


@given(st.integers(1, 96).flatmap(lambda n: st.tuples(st.just(n), st.integers(1, n))))
def test_split_layers_is_a_balanced_ordered_partition(case: tuple[int, int]) -> None:
    num_layers, num_stages = case
    ranges = split_layers(num_layers, num_stages)
    assert len(ranges) == num_stages
    assert [i for r in ranges for i in r] == list(range(num_layers))
    sizes = [len(r) for r in ranges]
    assert min(sizes) >= 1
    assert max(sizes) - min(sizes) <= 1
    # Documented rule: earlier stages take the remainder.
    assert sizes == sorted(sizes, reverse=True)
    assert split_layers(num_layers, num_stages) == ranges  # pure


def test_split_layers_examples() -> None:
    assert split_layers(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    assert split_layers(4, 1) == [range(0, 4)]
    assert split_layers(4, 4) == [range(i, i + 1) for i in range(4)]


@pytest.mark.parametrize(("layers", "stages"), [(4, 5), (4, 0), (4, -1), (0, 1)])
def test_split_layers_rejects_bad_input(layers: int, stages: int) -> None:
    with pytest.raises(ValueError, match="stage"):
        split_layers(layers, stages)


def test_build_stage_rejects_stage_out_of_range(tiny: ModelConfig) -> None:
    with pytest.raises(ValueError, match="out of range"):
        build_stage(tiny, 2, 2, SEED)


# --- presets -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "shape", "lr", "min_lr"),
    [
        ("small", (768, 3072, 12, 12), 6e-4, 6e-5),
        ("medium", (2048, 8192, 32, 24), 2e-4, 2e-5),
        ("large", (4096, 16384, 32, 32), 1.2e-4, 1.2e-5),
    ],
)
def test_paper_presets_match_official_shapes(
    name: str, shape: tuple[int, int, int, int], lr: float, min_lr: float
) -> None:
    cfg = get_preset(name)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_layers) == shape
    schedule = SCHEDULES[name]
    assert (schedule["lr"], schedule["min_lr"]) == (lr, min_lr)
    assert cfg.vocab_size == 128_002
    assert cfg.seq_len == 1024
    assert (schedule["warmup_steps"], schedule["total_steps"]) == (1000, 25_000)
    assert (cfg.rms_norm_eps, cfg.rope_theta, cfg.init_std) == (1e-6, 1e4, 0.02)
    assert cfg.attn_implementation == "sdpa"


def test_tiny_preset_is_cpu_sized(tiny: ModelConfig) -> None:
    assert 1_000_000 <= count_parameters(tiny) <= 5_000_000
    assert tiny.with_vocab(500).vocab_size == 500
    assert tiny.with_vocab(500).hidden_size == tiny.hidden_size


def test_get_preset_overrides_and_errors() -> None:
    assert get_preset("tiny", num_layers=2).num_layers == 2
    with pytest.raises(ValueError, match="choose one of"):
        get_preset("huge")
    with pytest.raises(ValueError, match="unknown ModelConfig field"):
        get_preset("tiny", hidden=64)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_heads": 3}, "not divisible by num_heads"),
        ({"hidden_size": 0}, "positive integer"),
        ({"num_layers": -1}, "positive integer"),
        ({"hidden_size": 12, "num_heads": 4}, "odd"),
        ({"attn_implementation": "flash_attention_2"}, "use one of"),
        ({"rms_norm_eps": 0.0}, "must be > 0"),
    ],
)
def test_model_config_validation_says_what_to_change(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        get_preset("tiny", **overrides)


def test_count_parameters_matches_built_models(tiny: ModelConfig) -> None:
    odd = ModelConfig(
        name="odd",
        vocab_size=301,
        hidden_size=48,
        intermediate_size=136,
        num_heads=3,
        num_layers=5,
        seq_len=8,
    )
    for cfg in (tiny, odd):
        assert count_parameters(cfg) == sum(p.numel() for p in build_model(cfg, SEED).parameters())
        for stage, layers in enumerate(split_layers(cfg.num_layers, 3)):
            built = build_stage(cfg, stage, 3, SEED)
            expected = count_stage_parameters(cfg, layers, first=stage == 0, last=stage == 2)
            assert expected == num_flat(built)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_count_parameters_matches_transformers_llama_on_meta(name: str) -> None:
    # An independent count: transformers' own LlamaForCausalLM, built on the meta device so
    # that even the 9.6 B-parameter preset costs no memory.
    cfg = PRESETS[name]
    with torch.device("meta"):
        reference = LlamaForCausalLM(to_llama_config(cfg))
    assert count_parameters(cfg) == sum(p.numel() for p in reference.parameters())


def test_count_parameters_of_small_by_hand() -> None:
    # 2 untied 128,002 x 768 embeddings + 12 x (4*768^2 + 3*768*3072 + 2*768) + 768.
    assert count_parameters(PRESETS["small"]) == 309_876_480


# --- init --------------------------------------------------------------------------------------


def test_same_seed_same_weights_different_seed_different(tiny: ModelConfig) -> None:
    a, b, c = build_model(tiny, SEED), build_model(tiny, SEED), build_model(tiny, SEED + 1)
    assert state_hash(a) == state_hash(b)
    assert state_hash(a) != state_hash(c)
    for (name, pa), (_, pc) in zip(a.named_parameters(), c.named_parameters(), strict=True):
        if not name.endswith("layernorm.weight") and name != "norm.weight":
            assert not torch.equal(pa, pc), name


@pytest.mark.parametrize("num_stages", [2, 4])
def test_stage_init_does_not_depend_on_split(tiny: ModelConfig, num_stages: int) -> None:
    full = dict(build_model(tiny, SEED).named_parameters())
    seen: set[str] = set()
    for stage in build_stages(tiny, num_stages, SEED):
        for name, p in stage.named_parameters():
            assert torch.equal(p, full[name]), name
            seen.add(name)
    assert seen == set(full)


def test_init_statistics_and_global_rng_untouched(tiny: ModelConfig) -> None:
    before = torch.random.get_rng_state()
    model = build_model(tiny, SEED)
    assert torch.equal(before, torch.random.get_rng_state())
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            assert abs(p.std().item() - tiny.init_std) < 0.1 * tiny.init_std, name
            assert abs(p.mean().item()) < 0.1 * tiny.init_std, name


def test_parameter_names_are_global(tiny: ModelConfig) -> None:
    last = build_stage(tiny, 3, 4, SEED)
    names = [n for n, _ in last.named_parameters()]
    assert "layers.3.self_attn.q_proj.weight" in names
    assert names[-2:] == ["norm.weight", "lm_head.weight"]
    assert not any(n.startswith("embed_tokens") for n in names)
    first = build_stage(tiny, 0, 4, SEED)
    assert next(iter(first.named_parameters()))[0] == "embed_tokens.weight"


# --- forward contract ------------------------------------------------------------------------


def test_forward_shapes_and_initial_loss(tiny: ModelConfig) -> None:
    stages = build_stages(tiny, 2, SEED)
    ids = _ids(tiny)
    hidden = stages[0](ids)
    assert hidden.shape == (2, T, tiny.hidden_size)
    assert stages[1](hidden).shape == (2, T, tiny.vocab_size)
    loss = stages[1](hidden, ids)
    assert loss.shape == (2,)
    # Near-uniform predictions at init.
    assert torch.allclose(loss, torch.full_like(loss, math.log(tiny.vocab_size)), atol=0.2)


def test_loss_is_per_sample_mean_and_ignores_masked_targets(tiny: ModelConfig) -> None:
    model = build_model(tiny, SEED)
    ids = _ids(tiny)
    targets = ids.roll(-1, dims=1)
    with torch.no_grad():
        logits = model(ids)
        per_token = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), targets.flatten(), reduction="none"
        ).view(2, T)
        assert torch.allclose(model(ids, targets), per_token.mean(dim=1), atol=1e-5)
        masked = targets.clone()
        masked[0, T // 2 :] = IGNORE_INDEX
        expected = per_token[0, : T // 2].mean()
        assert torch.allclose(model(ids, masked)[0], expected, atol=1e-5)


def test_stage_rejects_bad_inputs(tiny: ModelConfig) -> None:
    first, last = build_stages(tiny, 2, SEED)
    ids = _ids(tiny)
    with pytest.raises(ValueError, match="input ids"):
        first(ids.float())
    with pytest.raises(ValueError, match=r"\[0, "):
        first(ids + tiny.vocab_size)
    with pytest.raises(ValueError, match="hidden states"):
        last(ids)
    with pytest.raises(ValueError, match="hidden states"):
        last(torch.zeros(2, T, tiny.hidden_size + 1))
    with pytest.raises(ValueError, match="not the last stage"):
        first(ids, ids)
    with pytest.raises(ValueError, match="targets must be"):
        last(torch.zeros(2, T, tiny.hidden_size), ids[:, 1:])


# --- causality ---------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_future_tokens_never_change_earlier_logits(tiny: ModelConfig, backend: str) -> None:
    cfg = dataclasses.replace(tiny, attn_implementation=backend, num_layers=2)
    model = build_model(cfg, SEED)
    ids = _ids(cfg)
    cut = T // 2
    changed = ids.clone()
    changed[:, cut:] = (changed[:, cut:] + 1) % cfg.vocab_size
    with torch.no_grad():
        before, after = model(ids), model(changed)
    assert torch.allclose(before[:, :cut], after[:, :cut], atol=1e-6, rtol=0)
    assert not torch.allclose(before[:, cut:], after[:, cut:])


def test_causality_check_catches_the_official_eager_defect(
    tiny: ModelConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without our mask, eager attention is bidirectional (the official code's defect): the
    # test above would fail, so it really tests something.
    cfg = dataclasses.replace(tiny, attn_implementation="eager", num_layers=1)
    model = build_model(cfg, SEED)
    monkeypatch.setattr(model, "_attention_kwargs", lambda hidden: {"attention_mask": None})
    ids = _ids(cfg)
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % cfg.vocab_size
    with torch.no_grad():
        assert not torch.allclose(model(ids)[:, 0], model(changed)[:, 0], atol=1e-6, rtol=0)


def test_backends_agree(tiny: ModelConfig) -> None:
    ids = _ids(tiny)
    eager = build_model(dataclasses.replace(tiny, attn_implementation="eager"), SEED)
    sdpa = build_model(dataclasses.replace(tiny, attn_implementation="sdpa"), SEED)
    with torch.no_grad():
        assert torch.allclose(eager(ids), sdpa(ids), atol=1e-4)


# --- gradients and split equivalence ---------------------------------------------------------


def test_every_parameter_gets_a_nonzero_gradient(tiny: ModelConfig) -> None:
    stages = build_stages(tiny, 2, SEED)
    ids = _ids(tiny)
    _run_pipeline(stages, ids, ids.roll(-1, dims=1))
    for stage in stages:
        for name, p in stage.named_parameters():
            assert p.grad is not None, name
            assert p.grad.abs().sum() > 0, name
    assert stages[0].embed_tokens is not None


@pytest.mark.parametrize("num_stages", [1, 2, 4])
def test_split_model_equals_unsplit_model(tiny: ModelConfig, num_stages: int) -> None:
    ids = _ids(tiny, batch=3)
    targets = ids.roll(-1, dims=1)
    full = build_model(tiny, SEED).double()
    ref_loss = _run_pipeline([full], ids, targets)
    ref_grads = {n: p.grad for n, p in full.named_parameters()}

    stages = [s.double() for s in build_stages(tiny, num_stages, SEED)]
    loss = _run_pipeline(stages, ids, targets)
    assert torch.allclose(loss, ref_loss, rtol=1e-12, atol=0)
    grads = {n: p.grad for s in stages for n, p in s.named_parameters()}
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert grad is not None
        assert torch.allclose(grad, ref_grads[name], rtol=1e-9, atol=1e-12), name


def test_a_few_adam_steps_fit_one_batch(tiny: ModelConfig) -> None:
    # End-to-end sanity of the chained stages: the loss falls when memorising one batch.
    stages = build_stages(dataclasses.replace(tiny, num_layers=2), 2, SEED)
    params = [p for s in stages for p in s.parameters()]
    opt = torch.optim.AdamW(params, lr=3e-3)
    ids = _ids(tiny)
    targets = ids.roll(-1, dims=1)
    losses = []
    for _ in range(15):
        opt.zero_grad(set_to_none=True)
        losses.append(_run_pipeline(stages, ids, targets).item())
        opt.step()
    assert losses[-1] < 0.7 * losses[0]


# --- precision ---------------------------------------------------------------------------------


def test_bf16_autocast_keeps_fp32_master_and_close_loss(tiny: ModelConfig) -> None:
    ids = _ids(tiny)
    targets = ids.roll(-1, dims=1)
    fp32 = build_model(tiny, SEED)
    bf16 = build_model(dataclasses.replace(tiny, autocast_bf16=True), SEED)
    ref = fp32(ids, targets).mean()
    loss = bf16(ids, targets)
    assert loss.dtype == torch.float32
    loss = loss.mean()
    loss.backward()
    assert torch.isfinite(loss)
    assert abs(loss.item() - ref.item()) < 0.02 * ref.item()
    for name, p in bf16.named_parameters():
        assert p.dtype == torch.float32, name
        assert p.grad is not None and p.grad.dtype == torch.float32, name
    assert bf16(ids).dtype == torch.float32


# --- state helpers -----------------------------------------------------------------------------


def test_flat_params_round_trip(tiny: ModelConfig) -> None:
    stage = build_stage(tiny, 1, 2, SEED)
    vec = flat_params(stage)
    assert vec.dtype == torch.float32 and vec.dim() == 1 and vec.is_contiguous()
    assert vec.numel() == num_flat(stage)
    original = state_hash(stage)
    load_flat_params_(stage, vec * 2)
    assert torch.equal(flat_params(stage), vec * 2)
    assert state_hash(stage) != original
    load_flat_params_(stage, vec)
    assert state_hash(stage) == original
    # The vector is a copy, not a view of the weights.
    vec.zero_()
    assert state_hash(stage) == original


def test_load_flat_params_rejects_bad_vectors(tiny: ModelConfig) -> None:
    stage = build_stage(tiny, 1, 2, SEED)
    vec = flat_params(stage)
    before = state_hash(stage)
    for bad in (vec[:-1], torch.cat([vec, vec[:1]]), vec.view(1, -1), vec.long()):
        with pytest.raises(ValueError):
            load_flat_params_(stage, bad)
    assert state_hash(stage) == before


def test_state_hash_is_stable_and_sensitive(tiny: ModelConfig) -> None:
    stage = build_stage(tiny, 0, 4, SEED)
    digest = state_hash(stage)
    assert digest == state_hash(stage) == state_hash(build_stage(tiny, 0, 4, SEED))
    assert len(digest) == 64
    weights = {n: p.detach().clone() for n, p in stage.named_parameters()}
    assert state_hash(weights) == digest
    # Registration order does not matter; names, values and dtypes do.
    assert state_hash(dict(reversed(weights.items()))) == digest
    renamed = {("x." + n if i == 0 else n): t for i, (n, t) in enumerate(weights.items())}
    assert state_hash(renamed) != digest
    with torch.no_grad():
        p = next(stage.parameters())
        p[0, 0] = torch.nextafter(p[0, 0], torch.tensor(1.0))
    assert state_hash(stage) != digest
    assert state_hash({n: t.double() for n, t in weights.items()}) != digest
