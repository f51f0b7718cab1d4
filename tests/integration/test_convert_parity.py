"""HF -> mjax logits parity for every family, and mjax -> HF reproducing every tensor exactly."""

import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest

from mjax.config import from_dict
from mjax.convert import load_pretrained, mjax_to_hf
from mjax.storage import params as params_io
from mjax.convert.hf import model_config_from_hf, params_from_hf
from mjax.convert.spec import unflatten
from mjax.model import build_model
from tests.helpers.convert_utils import (FIXTURES, LOGITS_ATOL, NAMES, assert_same_tensors, convert_both_ways,
                                         next_token_loss, read_safetensors, reference)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """name -> (mjax checkpoint dir, HF dir exported back with small shards)."""
    return convert_both_ways(NAMES, tmp_path_factory.mktemp("convert"))


@pytest.mark.parametrize("name", NAMES)
def test_hf_directory_matches_reference_logits(name):
    ref = reference(name)
    model, cfg = load_pretrained(FIXTURES / name)
    logits = np.asarray(model(ref["tokens"]))
    assert logits.shape == ref["logits"].shape  # vocab padding removed
    np.testing.assert_allclose(logits, ref["logits"], atol=LOGITS_ATOL, rtol=0)
    assert next_token_loss(logits, ref["tokens"]) == pytest.approx(float(ref["loss"]), abs=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_mjax_checkpoint_matches_reference_logits(name, converted):
    ref = reference(name)
    model, cfg = load_pretrained(converted[name][0])
    np.testing.assert_allclose(np.asarray(model(ref["tokens"])), ref["logits"], atol=LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_round_trip_reproduces_every_tensor(name, converted):
    assert_same_tensors(FIXTURES / name, converted[name][1])
    hf_dir = converted[name][1]
    assert (hf_dir / "model.safetensors.index.json").exists()  # small shards forced an index
    src, dst = (json.loads((d / "config.json").read_text()) for d in (FIXTURES / name, hf_dir))
    assert model_config_from_hf(src) == model_config_from_hf(dst)
    assert src.get("eos_token_id") == dst.get("eos_token_id")  # unmanaged keys carried through


def test_export_without_the_original_hf_config(converted, tmp_path):
    """A model trained from scratch has no hf_config.json: the family is inferred and the tensors still match."""
    for name in ("qwen2_tied", "gpt2", "mistral_swa"):
        src = tmp_path / name
        shutil.copytree(converted[name][0], src)
        (src / params_io.HF_CONFIG).unlink()
        mjax_to_hf(src, tmp_path / f"{name}_hf", dtype="float32")
        original, exported = read_safetensors(FIXTURES / name), read_safetensors(tmp_path / f"{name}_hf")
        for k, a in original.items():
            np.testing.assert_array_equal(a.astype(np.float32), exported[k], err_msg=k)
        cfg = json.loads((tmp_path / f"{name}_hf" / "config.json").read_text())
        assert model_config_from_hf(cfg) == model_config_from_hf(json.loads((FIXTURES / name / "config.json")
                                                                            .read_text()))


def test_checkpoint_layout_is_a_plain_orbax_pytree(converted):
    """What --load_params_only reads: <dir>/params restores with stock Orbax onto the model's abstract params."""
    import orbax.checkpoint as ocp

    ckpt = converted["llama3_gqa"][0]
    assert {"config.json", "hf_config.json", "params", "tokenizer.json"} <= {p.name for p in ckpt.iterdir()}
    cfg = from_dict(json.loads((ckpt / "config.json").read_text()))
    model_def = build_model(model_config_from_hf(json.loads((ckpt / "hf_config.json").read_text())))
    assert cfg.model == model_def.cfg
    abstract = model_def.abstract_params()
    restored = ocp.StandardCheckpointer().restore((ckpt / "params").absolute(), abstract)
    assert jax.tree.map(lambda x: x.shape, restored) == jax.tree.map(lambda x: x.shape, abstract)
    emb = np.asarray(restored["embed"]["embedding"])
    assert emb.shape[0] == 384 and not emb[300:].any()  # vocab 300 padded with zero rows
    assert str(params_io.param_metadata(ckpt)["layers/mlp/up_proj/kernel"][1]) == "bfloat16"  # stored as in HF


def test_restore_adapts_vocab_padding_and_shards(converted):
    ckpt = converted["gpt2"][0]
    model_cfg = model_config_from_hf(json.loads((ckpt / "hf_config.json").read_text()))
    wider = dataclasses.replace(model_cfg, make_vocab_size_divisible_by=512)
    mesh = jax.make_mesh((len(jax.devices()),), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                            build_model(wider).abstract_params())
    params = params_io.restore(ckpt, abstract)
    assert params["embed"]["embedding"].shape == (512, 64) and params["embed"]["embedding"].sharding == sharding
    _, flat = params_from_hf(FIXTURES / "gpt2")
    np.testing.assert_array_equal(np.asarray(params["embed"]["embedding"])[:384], flat["embed/embedding"])
    np.testing.assert_array_equal(np.asarray(params["layers"]["attn"]["q_proj"]["kernel"]),
                                  unflatten(flat)["layers"]["attn"]["q_proj"]["kernel"])


@pytest.mark.parametrize("name, change", [
    ("mistral_swa", {"window_size": None}),
    ("llama3_gqa", {"rope_scaling": "none"}),
    ("qwen2_tied", {"add_qkv_bias": False}),
])
def test_fixtures_are_sensitive_to_the_feature_they_cover(name, change):
    """The parity tests would catch a wrong window, RoPE scaling or dropped bias: each changes the logits."""
    model, cfg = load_pretrained(FIXTURES / name)
    params = model.params
    if change.get("add_qkv_bias") is False:
        params = jax.tree.map(lambda x: x, params)
        for p in ("q_proj", "k_proj", "v_proj"):
            del params["layers"]["attn"][p]["bias"]
    changed = build_model(dataclasses.replace(cfg.model, **change))
    ref = reference(name)
    logits = np.asarray(changed.apply(params, ref["tokens"]))[..., :cfg.model.vocab_size]
    assert np.abs(logits - ref["logits"]).max() > 100 * LOGITS_ATOL
