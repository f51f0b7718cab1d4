"""Mixture-of-experts checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) against Hugging Face's fixtures: logits and
routing in fp32, hf -> mjax -> hf bit for bit, KV-cache decoding and generation, and how the tables index layers
of each kind and experts."""

import dataclasses
import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mjax
from mjax.convert import hf_to_mjax, mjax_to_hf
from mjax.convert.hf import FAMILIES, model_config_from_hf, params_from_hf
from mjax.convert.spec import Dims
from mjax.inference.generate import generate
from mjax.model import build_model
from mjax.inference.decode import forward_with_cache, init_cache
from tests.helpers.convert_utils import (FIXTURES, LOGITS_ATOL, MOE_NAMES, assert_same_tensors, convert_both_ways,
                                         next_token_loss, read_safetensors, reference)
from tests.helpers.numpy_reference import forward_hf

# Training runs and compiled steps: the full suite (make test-all) only, not make test.
pytestmark = pytest.mark.slow


@functools.cache
def _fixture_model(name):
    """load_pretrained of the HF fixture, once per module: the tests share its compiled forward (model(tokens) of
    the reference tokens' shape)."""
    return mjax.load_pretrained(FIXTURES / name)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """name -> (mjax checkpoint dir, HF dir exported back with small shards)."""
    return convert_both_ways(MOE_NAMES, tmp_path_factory.mktemp("convert_moe"))


@pytest.mark.parametrize("name", MOE_NAMES)
def test_hf_directory_and_converted_checkpoint_match_reference_logits(name, converted):
    ref = reference(name)
    for path in (FIXTURES / name, converted[name][0]):
        model, _ = _fixture_model(name) if path == FIXTURES / name else mjax.load_pretrained(path)
        logits = np.asarray(model(ref["tokens"]))
        np.testing.assert_allclose(logits, ref["logits"], atol=LOGITS_ATOL, rtol=0, err_msg=str(path))
        assert next_token_loss(logits, ref["tokens"]) == pytest.approx(float(ref["loss"]), abs=1e-5)


@pytest.mark.parametrize("name", MOE_NAMES)
def test_every_moe_layer_routes_as_hf_does(name):
    """Per MoE layer (in HF layer order = the moe_layers stack order), the tokens each expert received equal those
    of HF's routing; the fixtures have no choice within float noise of a tie (make_hf_fixtures.py checks)."""
    ref = reference(name)
    model, cfg = _fixture_model(name)
    _, stats, _ = model.model_def.bind(model.params).forward(jnp.asarray(ref["tokens"]))
    got = np.asarray(stats["tokens_per_expert"])  # [MoE layers, E]
    want = np.stack([np.bincount(ids.reshape(-1), minlength=cfg.model.num_experts) for ids in ref["router_ids"]])
    assert [i for i, moe in enumerate(cfg.model.moe_layer_pattern()) if moe] == ref["router_layers"].tolist()
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", MOE_NAMES)
def test_round_trip_reproduces_every_tensor_and_config(name, converted):
    assert_same_tensors(FIXTURES / name, converted[name][1])
    assert (converted[name][1] / "model.safetensors.index.json").exists()
    src, dst = (json.loads((d / "config.json").read_text()) for d in (FIXTURES / name, converted[name][1]))
    assert model_config_from_hf(src) == model_config_from_hf(dst)
    keys = ("architectures", "num_hidden_layers", "num_experts_per_tok", "num_local_experts", "num_experts",
            "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob", "mlp_only_layers",
            "decoder_sparse_step", "intermediate_size", "head_dim", "num_key_value_heads", "qkv_bias",
            "router_jitter_noise", "sliding_window", "eos_token_id")
    for key in keys:
        if key in src and not (key == "head_dim" and src[key] is None):
            assert dst.get(key) == src[key] or (key == "sliding_window" and not src[key] and not dst.get(key)), key


def test_export_without_the_original_hf_config_infers_the_family(converted, tmp_path):
    """A model trained from scratch has no hf_config.json: each MoE family is recognised from the mjax config."""
    for name in MOE_NAMES:
        src = tmp_path / name
        shutil.copytree(converted[name][0], src)
        (src / "hf_config.json").unlink()
        mjax_to_hf(src, tmp_path / f"{name}_hf")
        cfg = json.loads((tmp_path / f"{name}_hf" / "config.json").read_text())
        original = json.loads((FIXTURES / name / "config.json").read_text())
        assert cfg["architectures"] == original["architectures"]
        assert model_config_from_hf(cfg) == model_config_from_hf(original)
        exported = read_safetensors(tmp_path / f"{name}_hf")
        for k, a in read_safetensors(FIXTURES / name).items():
            assert a.tobytes() == exported[k].tobytes(), k


def test_stacks_follow_the_layer_kinds_and_experts_stack_in_order():
    """Qwen2-MoE fixture, layers [MoE, dense, MoE]: moe_layers row 1 is HF layer 2, layers row 0 is HF layer 1, and
    expert j of an MoE layer is row j of its [E, ...] block (checked with plain transposes of the HF tensors)."""
    hf = read_safetensors(FIXTURES / "qwen2_moe")
    m, flat = params_from_hf(FIXTURES / "qwen2_moe")
    assert m.moe_layer_pattern() == (True, False, True)
    f32 = lambda name: hf[name].astype(np.float32)  # noqa: E731
    np.testing.assert_array_equal(flat["layers/mlp/up_proj/kernel"][0], f32("model.layers.1.mlp.up_proj.weight").T)
    np.testing.assert_array_equal(flat["moe_layers/attn/o_proj/kernel"][1].reshape(-1, 64),
                                  f32("model.layers.2.self_attn.o_proj.weight").T)
    np.testing.assert_array_equal(flat["layers/attn_norm/scale"][0], f32("model.layers.1.input_layernorm.weight"))
    for j in range(4):
        for hf_name, mj in (("gate_proj", "gate_proj"), ("up_proj", "up_proj"), ("down_proj", "down_proj")):
            np.testing.assert_array_equal(flat[f"moe_layers/mlp/experts/{mj}/kernel"][1, j],
                                          f32(f"model.layers.2.mlp.experts.{j}.{hf_name}.weight").T)
    np.testing.assert_array_equal(flat["moe_layers/mlp/router/kernel"][0], f32("model.layers.0.mlp.gate.weight").T)
    np.testing.assert_array_equal(flat["moe_layers/mlp/shared_expert_gate/kernel"][1],
                                  f32("model.layers.2.mlp.shared_expert_gate.weight").T)
    family, dims = FAMILIES["Qwen2MoeForCausalLM"], Dims.of(m)
    by_target = {r.mjax[0]: r for r in family.rules}
    assert [n for _, n in family.hf_tensors(by_target["layers/attn/q_proj/kernel"], dims)] == [
        "model.layers.1.self_attn.q_proj.weight"]
    assert [n for _, n in family.hf_tensors(by_target["moe_layers/attn/q_proj/kernel"], dims)] == [
        "model.layers.0.self_attn.q_proj.weight", "model.layers.2.self_attn.q_proj.weight"]
    experts = family.hf_tensors(by_target["moe_layers/mlp/experts/down_proj/kernel"], dims)
    assert experts[:2] == [((0, 0), "model.layers.0.mlp.experts.0.down_proj.weight"),
                           ((0, 1), "model.layers.0.mlp.experts.1.down_proj.weight")]
    assert experts[-1] == ((1, 3), "model.layers.2.mlp.experts.3.down_proj.weight") and len(experts) == 8


@pytest.mark.parametrize("name", MOE_NAMES)
def test_fixtures_are_sensitive_to_the_routing_normalisation(name):
    """The parity tests would catch a wrong norm_topk_prob translation: flipping it changes the logits."""
    model, cfg = _fixture_model(name)
    flipped = build_model(dataclasses.replace(cfg.model, moe_router_pre_softmax=not cfg.model.moe_router_pre_softmax))
    ref = reference(name)
    logits = np.asarray(flipped.apply(model.params, ref["tokens"]))[..., :cfg.model.vocab_size]
    assert np.abs(logits - ref["logits"]).max() > 100 * LOGITS_ATOL


def test_mixtral_sliding_window_matches_the_numpy_reference(tmp_path):
    """Mixtral's sliding_window (one window for every layer, as Mistral's) is kept: the fixture with a window of 8 <
    24 tokens, against the NumPy restatement of HF's forward; and exported back."""
    d = tmp_path / "mixtral_swa"
    shutil.copytree(FIXTURES / "mixtral", d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["sliding_window"] = 8
    (d / "config.json").write_text(json.dumps(cfg))
    ref = reference("mixtral")
    model, mcfg = mjax.load_pretrained(d)
    assert mcfg.model.window_size == 8
    want = forward_hf(read_safetensors(d), cfg, ref["tokens"])
    logits = np.asarray(model(ref["tokens"]))
    np.testing.assert_allclose(logits, want, atol=LOGITS_ATOL, rtol=0)
    assert np.abs(want - ref["logits"]).max() > 100 * LOGITS_ATOL  # the window changes the logits
    hf_to_mjax(d, tmp_path / "mjax")
    mjax_to_hf(tmp_path / "mjax", tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["sliding_window"] == 8


@pytest.mark.parametrize("name", MOE_NAMES)
def test_cached_decoding_and_greedy_generation_equal_the_full_forward(name):
    """The full forwards are model(tokens) of one shape, compiled once: a causal model's logits at position i are
    those of the prefix ending at i, so one forward of the generated sequence checks each greedy choice."""
    model, cfg = _fixture_model(name)
    tokens = jnp.asarray(reference(name)["tokens"])
    b, t = tokens.shape
    vocab = cfg.model.vocab_size
    full = model(tokens)  # [B, T, V]
    cache = init_cache(cfg.model, b, t)
    prompt = 10
    step = jax.jit(forward_with_cache, static_argnums=0)
    logits, cache = step(model.model_def, model.params, tokens[:, :prompt],
                         jnp.broadcast_to(jnp.arange(prompt), (b, prompt)), cache)
    steps = [logits]
    for i in range(prompt, t):
        logits, cache = step(model.model_def, model.params, tokens[:, i:i + 1], jnp.full((b, 1), i), cache)
        steps.append(logits)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(steps, 1))[..., :vocab], np.asarray(full), atol=2e-5,
                               rtol=0)

    new = np.asarray(generate(model.model_def, model.params, tokens[:, :6], 4))
    seq = np.asarray(tokens).copy()
    seq[:, 6:10] = new  # the prompt and the generated tokens, then tokens no logit below depends on
    np.testing.assert_array_equal(new, np.argmax(np.asarray(model(seq))[:, 5:9], -1))


def test_a_malformed_rule_is_refused_when_its_table_is_built():
    from mjax.convert.spec import rule

    with pytest.raises(ValueError, match="must all be in one of"):
        rule("model.layers.{i}.mlp.w", ("layers/mlp/up_proj/kernel", "moe_layers/mlp/up_proj/kernel"))
    with pytest.raises(ValueError, match="must all be in one of"):
        rule("model.layers.{i}.w", "embed/embedding")
    with pytest.raises(ValueError, match="must be per layer"):
        rule("experts.{j}.w", "moe_layers/mlp/experts/up_proj/kernel")
