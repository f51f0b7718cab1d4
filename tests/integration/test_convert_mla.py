"""DeepSeek-V2 and DeepSeek-V3 (multi-latent attention) against Hugging Face's fixtures made with transformers' own
classes (tools/make_hf_fixtures.py): V2 without q LoRA and group-limited greedy softmax routing, V3 with q LoRA,
YaRN, sigmoid routing with e_score_correction_bias. fp32 logits and routing, hf -> mjax -> hf and mjax -> hf -> mjax
bit for bit, the config keys mjax cannot express, and FP8 checkpoints with block scales (read dequantised)."""

import dataclasses
import json
import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import mjax
from mjax.convert import hf_to_mjax, mjax_to_hf
from mjax.convert.hf import model_config_from_hf, params_from_hf
from mjax.convert.safetensors_io import SafetensorsWriter
from mjax.convert.spec import ConversionError
from mjax.model import build_model
from mjax.storage import params as params_io
from tests.helpers.convert_utils import (FIXTURES, LOGITS_ATOL, assert_same_tensors, convert_both_ways,
                                         next_token_loss, read_safetensors, reference)

pytestmark = pytest.mark.slow  # compiles two small models several times
NAMES = ("deepseek_v2", "deepseek_v3")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return convert_both_ways(NAMES, tmp_path_factory.mktemp("convert_mla"))


def _hf_config(name) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())


@pytest.mark.parametrize("name", NAMES)
def test_logits_and_routing_match_hf(name, converted):
    ref = reference(name)
    for path in (FIXTURES / name, converted[name][0]):
        model, cfg = mjax.load_pretrained(path)
        logits = np.asarray(model(ref["tokens"]))
        np.testing.assert_allclose(logits, ref["logits"], atol=LOGITS_ATOL, rtol=0, err_msg=str(path))
        assert next_token_loss(logits, ref["tokens"]) == pytest.approx(float(ref["loss"]), abs=1e-5)
    _, stats, _ = model.model_def.bind(model.params).forward(jnp.asarray(ref["tokens"]))
    got = np.asarray(stats["tokens_per_expert"])  # [MoE layers, E]
    want = np.stack([np.bincount(ids.reshape(-1), minlength=cfg.model.num_experts) for ids in ref["router_ids"]])
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name, change", [
    ("deepseek_v3", {"rope_scaling": "none"}),  # YaRN's frequencies and both mscale factors
    ("deepseek_v3", {"moe_router_group_score_topk": 1}),  # V3 ranks groups by their best two scores
    ("deepseek_v2", {"moe_router_num_groups": None, "moe_router_group_topk": None,
                     "moe_router_group_score_topk": None}),
])
def test_fixtures_are_sensitive_to_the_feature_they_cover(name, change):
    model, cfg = mjax.load_pretrained(FIXTURES / name)
    ref = reference(name)
    changed = build_model(dataclasses.replace(cfg.model, **change))
    logits = np.asarray(changed.apply(model.params, ref["tokens"]))[..., :cfg.model.vocab_size]
    assert np.abs(logits - ref["logits"]).max() > 100 * LOGITS_ATOL


@pytest.mark.parametrize("name", NAMES)
def test_hf_round_trip_reproduces_every_tensor_and_config(name, converted):
    assert_same_tensors(FIXTURES / name, converted[name][1])
    original, exported = _hf_config(name), json.loads((converted[name][1] / "config.json").read_text())
    assert model_config_from_hf(exported) == model_config_from_hf(original)
    for key in ("architectures", "model_type", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim", "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "first_k_dense_replace",
                "routed_scaling_factor", "n_group", "topk_group", "norm_topk_prob", "eos_token_id"):
        assert exported[key] == original[key], key
    assert ("rope_parameters" in exported) == ("rope_parameters" in original)


@pytest.mark.parametrize("name", NAMES)
def test_mjax_round_trip_reproduces_every_parameter(name, converted, tmp_path):
    """Random parameters in mjax's layout (RoPE dims half-split; each in its stored dtype) -> HF -> mjax, bit for
    bit."""
    src = tmp_path / "mjax"
    shutil.copytree(converted[name][0], src)
    meta = params_io.param_metadata(src)
    rng = np.random.default_rng(5)
    params = {p: rng.standard_normal(shape).astype(ml_dtypes.bfloat16 if dtype == np.dtype(ml_dtypes.bfloat16)
                                                    else dtype) for p, (shape, dtype) in meta.items()}
    vocab = _hf_config(name)["vocab_size"]  # the vocab padding is zero by definition (export drops it)
    params["embed/embedding"][vocab:] = 0
    params["lm_head/kernel"][:, vocab:] = 0
    shutil.rmtree(src / params_io.PARAMS)
    params_io.save_params(src, params_io.unflatten(params))
    mjax_to_hf(src, tmp_path / "hf", max_shard_bytes=100_000)
    hf_to_mjax(tmp_path / "hf", tmp_path / "back")
    back = params_io.read_params(tmp_path / "back")
    assert sorted(back) == sorted(params)
    for p, a in params.items():
        assert (back[p].dtype, back[p].tobytes()) == (a.dtype, a.tobytes()), p


@pytest.mark.parametrize("name, change, key", [
    ("deepseek_v3", {"rope_interleave": False}, "rope_interleave"),
    ("deepseek_v3", {"norm_topk_prob": False}, "norm_topk_prob"),
    ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method"),
    ("deepseek_v2", {"num_key_value_heads": 2}, "num_key_value_heads"),
    ("deepseek_v2", {"first_k_dense_replace": 2}, "first_k_dense_replace"),
    ("deepseek_v3", {"rope_scaling": dict(_hf_config("deepseek_v3")["rope_scaling"], attention_factor=2.0)},
     "attention_factor"),
])
def test_unsupported_config_keys_are_named(name, change, key):
    with pytest.raises(ConversionError, match=key):
        model_config_from_hf(dict(_hf_config(name), **change))


def _fp8_blocks(w, block):
    """Test-side blockwise quantizer: (float8_e4m3fn [O, I], scale_inv [O/b, I/b] fp32), amax of a block -> 448."""
    o, i = w.shape
    so, si = -(-o // block), -(-i // block)
    padded = np.zeros((so * block, si * block), np.float32)
    padded[:o, :i] = np.abs(w)
    scale = np.maximum(padded.reshape(so, block, si, block).max((1, 3)), 1e-12) / 448.0
    q = np.empty((o, i), ml_dtypes.float8_e4m3fn)
    for r in range(so):
        for c in range(si):
            rows, cols = slice(r * block, (r + 1) * block), slice(c * block, (c + 1) * block)
            q[rows, cols] = (w[rows, cols] / scale[r, c]).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def _write(directory, cfg, tensors):
    writer = SafetensorsWriter(directory, [(k, a.shape, a.dtype) for k, a in tensors.items()], 100_000)
    for k, a in tensors.items():
        writer.write(k, a)
    writer.close()
    (directory / "config.json").write_text(json.dumps(cfg))


def test_fp8_block_scaled_checkpoint_imports_dequantised(tmp_path):
    """DeepSeek-V3's published layout: linear weights in float8_e4m3fn with weight_scale_inv per 16 x 16 block here
    (128 x 128 there). Import equals importing the bf16 weights dequantised block by block in this test."""
    cfg, block = _hf_config("deepseek_v3"), 16
    fp8, dequantised = {}, {}
    for k, a in read_safetensors(FIXTURES / "deepseek_v3").items():
        if not (k.endswith("proj.weight") or k.endswith("proj_with_mqa.weight")):  # norms, router, embeddings
            fp8[k] = dequantised[k] = a
            continue
        w = a.astype(np.float32)
        q, scale = _fp8_blocks(w, block)
        fp8[k], fp8[k[:-len("weight")] + "weight_scale_inv"] = q, scale
        d = np.empty(w.shape, np.float32)
        for r in range(scale.shape[0]):
            for c in range(scale.shape[1]):
                rows, cols = slice(r * block, (r + 1) * block), slice(c * block, (c + 1) * block)
                d[rows, cols] = q[rows, cols].astype(np.float32) * scale[r, c]
        assert np.abs(d - w).max() <= np.abs(w).max() / 8  # e4m3 keeps 3 mantissa bits: the scales point the right way
        dequantised[k] = d.astype(ml_dtypes.bfloat16)
    assert sum(k.endswith("weight_scale_inv") for k in fp8) >= 20
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [block, block]}
    _write(tmp_path / "fp8", dict(cfg, quantization_config=quant), fp8)
    _write(tmp_path / "bf16", cfg, dequantised)
    _, got = params_from_hf(tmp_path / "fp8")
    _, want = params_from_hf(tmp_path / "bf16")
    assert sorted(got) == sorted(want)
    for p, a in want.items():
        assert (got[p].dtype, got[p].tobytes()) == (a.dtype, a.tobytes()), p
    hf_to_mjax(tmp_path / "fp8", tmp_path / "mjax")
    mjax_to_hf(tmp_path / "mjax", tmp_path / "out")  # written in bf16, so without the FP8 quantization_config
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    bad = dict(cfg, quantization_config=dict(quant, fmt="e5m2"))
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ConversionError, match="fmt"):
        params_from_hf(tmp_path / "fp8")
