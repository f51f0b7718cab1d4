import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mjax.config import ExecutionConfig, ModelConfig
from mjax.model import build_model
from mjax.parallel.remat import LayerRunner
from tests.helpers import numpy_reference

BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, vocab_size=200,
            make_vocab_size_divisible_by=64, max_position_embeddings=64)
FAMILIES = {
    "gpt2": ModelConfig(**BASE, normalization="layernorm", activation="gelu", position_embedding_type="learned",
                        add_bias_linear=True, untie_embeddings_and_output_weights=False),
    "llama3": ModelConfig(**BASE, num_query_groups=2, rope_scaling="llama3", rope_scaling_factor=8.0,
                          rope_original_max_positions=64, rotary_base=500000.0),
    "mqa": ModelConfig(**BASE, num_query_groups=1, untie_embeddings_and_output_weights=False),
    "qwen2": ModelConfig(**BASE, num_query_groups=2, add_qkv_bias=True, norm_epsilon=1e-6, rotary_base=1e6),
    "mistral": ModelConfig(**BASE, num_query_groups=2, window_size=3),
}


def _randomize_biases(params, key):
    """Biases start at zero; give them values so the oracle comparison exercises them."""
    leaves, tree = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(key, len(leaves))
    out = [jax.random.normal(k, x.shape) * 0.1 if p[-1].key in ("bias",) else x
           for (p, x), k in zip(leaves, keys)]
    return jax.tree_util.tree_unflatten(tree, out)


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_matches_numpy_oracle(family):
    cfg = FAMILIES[family]
    model = build_model(cfg)
    params = _randomize_biases(model.init(jax.random.key(1)), jax.random.key(2))
    tokens = np.asarray(jax.random.randint(jax.random.key(3), (2, 12), 0, cfg.vocab_size))
    logits = jax.jit(model.apply)(params, tokens)
    assert logits.shape == (2, 12, cfg.padded_vocab_size()) and logits.dtype == jnp.float32
    expected = numpy_reference.forward(jax.device_get(params), tokens, cfg)
    np.testing.assert_allclose(np.asarray(logits), expected, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("family", ["gpt2", "llama3"])
def test_bf16_compute_keeps_fp32_params_and_logits(family):
    cfg = FAMILIES[family]
    model = build_model(cfg, dataclasses.make_dataclass("P", [("compute_dtype", str), ("params_dtype", str)])(
        "bfloat16", "float32"))
    params = model.init(jax.random.key(0))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
    tokens = np.arange(16).reshape(2, 8) % cfg.vocab_size
    logits = jax.jit(model.apply)(params, tokens)
    assert logits.dtype == jnp.float32
    expected = numpy_reference.forward(jax.device_get(params), tokens, cfg)
    err = np.max(np.abs(np.asarray(logits) - expected)) / np.std(expected)
    assert 1e-4 < err < 0.05, err  # bf16 rounding is there (an fp32 run is ~1e-6 off), and stays bf16-sized


def test_parameter_layout_per_family():
    tied = build_model(FAMILIES["gpt2"]).abstract_params()
    assert "lm_head" not in tied and "pos_embed" in tied
    assert tied["layers"]["attn"]["q_proj"]["bias"].shape == (2, 4, 16)
    assert tied["layers"]["mlp"]["up_proj"]["bias"].shape == (2, 96)
    qwen = build_model(FAMILIES["qwen2"]).abstract_params()
    assert "bias" in qwen["layers"]["attn"]["k_proj"] and "bias" not in qwen["layers"]["attn"]["o_proj"]
    assert qwen["lm_head"]["kernel"].shape == (64, 256)  # vocab 200 padded to a multiple of 64
    assert qwen["layers"]["attn"]["k_proj"]["kernel"].shape == (2, 64, 2, 16)  # GQA: 2 KV heads, stacked layers
    axes = build_model(FAMILIES["qwen2"]).logical_axes()
    assert axes["layers"]["attn"]["k_proj"]["kernel"] == ("layers", "embed", "kv_heads", "head_dim")
    assert axes["embed"]["embedding"] == ("vocab", "embed")


def test_causal_and_sliding_window():
    cfg = FAMILIES["mistral"]
    model = build_model(cfg)
    params = model.init(jax.random.key(0))
    a = np.arange(10)[None] + 3
    b = a.copy()
    b[0, 9] = 150  # change the last token: no earlier logit may change
    la, lb = (np.asarray(model.apply(params, x)) for x in (a, b))
    np.testing.assert_allclose(la[:, :9], lb[:, :9], atol=1e-6)
    c = a.copy()
    c[0, 0] = 150  # with window 3 and 2 layers, position 0 reaches at most position 4
    lc = np.asarray(model.apply(params, c))
    assert np.abs(lc[0, 5:] - la[0, 5:]).max() < 1e-6
    assert np.abs(lc[0, 4] - la[0, 4]).max() > 1e-6


@pytest.mark.parametrize("family", ["llama3", "gpt2"])
def test_packed_documents_equal_separate_runs(family):
    cfg = FAMILIES[family]
    model = build_model(cfg)
    params = model.init(jax.random.key(0))
    docs = [np.arange(5) + 7, np.arange(7) + 40]
    packed = np.concatenate(docs)[None]
    segments = np.array([[1] * 5 + [2] * 7])
    positions = np.concatenate([np.arange(5), np.arange(7)])[None]
    out = np.asarray(model.apply(params, packed, positions, segments))
    np.testing.assert_allclose(out[0, :5], np.asarray(model.apply(params, docs[0][None]))[0], atol=1e-5)
    np.testing.assert_allclose(out[0, 5:], np.asarray(model.apply(params, docs[1][None]))[0], atol=1e-5)


@pytest.mark.slow  # compile-heavy: several programs (or a train step) compiled
def test_scan_and_unrolled_layers_agree_and_unrolled_gradients_are_concatenated():
    cfg = FAMILIES["llama3"]
    params = build_model(cfg).init(jax.random.key(0))
    tokens = np.arange(8)[None]
    unrolled = ExecutionConfig(scan_layers=False)
    models = build_model(cfg), build_model(cfg, execution=unrolled, runner=LayerRunner(unrolled))
    a, b = (m.apply(params, tokens) for m in models)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    grads = [jax.grad(lambda p, m=m: jnp.sum(m.apply(p, tokens) ** 2))(params) for m in models]
    for ga, gb in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
        # float32 sums in a different order: differences scale with the leaf's largest gradient (measured: 1e-7 of
        # it past rtol; tolerance 20x)
        scale = float(np.max(np.abs(np.asarray(ga))))
        np.testing.assert_allclose(np.asarray(ga), np.asarray(gb), rtol=1e-4, atol=2e-6 * scale)
    # Per-layer gradients go into the stacked gradient by one concatenate, not by padding each to the whole stack
    # and adding them up (L full-size additions).
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda p: jnp.sum(models[1].apply(p, tokens))))(params))
    padded = {tuple(map(int, m.split(","))) for m in re.findall(r"\w+\[([\d,]+)\] = pad\[", jaxpr)}
    stacked = {a.shape for a in jax.tree.leaves(params["layers"])}
    assert not padded & stacked and " concatenate[" in jaxpr


def test_moe_models_stack_dense_and_moe_blocks_apart():
    cfg = dataclasses.replace(FAMILIES["llama3"], num_layers=3, num_experts=4, moe_ffn_hidden_size=16,
                              moe_first_dense_layers=1)
    shapes = jax.tree.map(lambda a: a.shape, build_model(cfg).abstract_params())
    assert shapes["layers"]["mlp"]["up_proj"]["kernel"][0] == 1  # the first layer stays dense
    assert shapes["moe_layers"]["mlp"]["experts"]["up_proj"]["kernel"] == (2, 4, cfg.hidden_size, 16)
    assert shapes["moe_layers"]["attn"] == shapes["layers"]["attn"] | {
        k: jax.tree.map(lambda s: (2, *s[1:]), v, is_leaf=lambda x: isinstance(x, tuple))
        for k, v in shapes["layers"]["attn"].items()}
