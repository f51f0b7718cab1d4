"""DeepSeek-V3's multi-token prediction layer (model.layers.{num_hidden_layers}.*, num_nextn_predict_layers=1) in
both directions, on the tiny V3 fixture with an MTP layer added: every tensor lands where mjax/convert/deepseek.py's
table says (the block read as the model's blocks are, eh_proj transposed), hf -> mjax -> hf and mjax -> hf -> mjax
bit for bit, the copies of the embedding and output layer checked on import, and a checkpoint whose config.json
declares no MTP layer refusing the layer's tensors as before."""

import json
import shutil

import ml_dtypes
import numpy as np
import pytest

from mjax.convert import hf_to_mjax, mjax_to_hf
from mjax.convert.hf import model_config_from_hf
from mjax.convert.safetensors_io import SafetensorsWriter
from mjax.convert.spec import ConversionError
from mjax.storage import params as params_io
from tests.helpers.convert_utils import FIXTURES, assert_same_tensors, read_safetensors

SOURCE = FIXTURES / "deepseek_v3"


def _write(directory, cfg, tensors):
    directory.mkdir(parents=True)
    writer = SafetensorsWriter(directory, [(k, a.shape, a.dtype) for k, a in tensors.items()], 100_000)
    for k, a in tensors.items():
        writer.write(k, a)
    writer.close()
    (directory / "config.json").write_text(json.dumps(cfg))


def _with_mtp_layer():
    """(config, tensors) of the V3 fixture plus one MTP layer: its block is the last layer's tensors times 2 (exact
    in any float format), its norms and eh_proj random, its embed_tokens and shared_head.head copies."""
    cfg, tensors = json.loads((SOURCE / "config.json").read_text()), read_safetensors(SOURCE)
    n, d = cfg["num_hidden_layers"], cfg["hidden_size"]
    last, mtp = f"model.layers.{n - 1}.", f"model.layers.{n}."
    out = dict(tensors)
    for k, a in tensors.items():
        if k.startswith(last):
            out[mtp + k[len(last):]] = (a.astype(np.float32) * 2).astype(a.dtype)
    rng = np.random.default_rng(7)
    norm_dtype = tensors["model.norm.weight"].dtype
    for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
        out[mtp + name] = rng.standard_normal(d).astype(norm_dtype)
    linear_dtype = tensors[last + "self_attn.o_proj.weight"].dtype
    out[mtp + "eh_proj.weight"] = rng.standard_normal((d, 2 * d)).astype(linear_dtype)
    out[mtp + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].copy()
    out[mtp + "shared_head.head.weight"] = tensors["lm_head.weight"].copy()
    return dict(cfg, num_nextn_predict_layers=1), out


@pytest.fixture(scope="module")
def mtp_fixture(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert_mtp")
    cfg, tensors = _with_mtp_layer()
    _write(root / "hf", cfg, tensors)
    hf_to_mjax(root / "hf", root / "mjax")
    mjax_to_hf(root / "mjax", root / "back", max_shard_bytes=100_000)
    return root, cfg, tensors


def _flat(directory) -> dict:
    return params_io.read_params(directory)


def test_the_mtp_layer_lands_in_the_mtp_params(mtp_fixture):
    root, cfg, tensors = mtp_fixture
    assert model_config_from_hf(cfg).mtp_num_layers == 1
    params, mtp = _flat(root / "mjax"), f"model.layers.{cfg['num_hidden_layers']}."
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    np.testing.assert_array_equal(f32(params["mtp/layers/eh_proj/kernel"][0]), f32(tensors[mtp + "eh_proj.weight"]).T)
    for mj, hf in (("enorm", "enorm"), ("hnorm", "hnorm"), ("final_norm", "shared_head.norm")):
        np.testing.assert_array_equal(f32(params[f"mtp/layers/{mj}/scale"][0]), f32(tensors[mtp + hf + ".weight"]))
    # The block is read by the same transforms as the model's MoE blocks: twice the last one, exactly.
    block = {p[len("mtp/layers/block/"):]: a for p, a in params.items() if p.startswith("mtp/layers/block/")}
    assert block and all(f"moe_layers/{p}" in params for p in block)
    for p, a in block.items():
        np.testing.assert_array_equal(f32(a[0]), 2 * f32(params[f"moe_layers/{p}"][-1]), err_msg=p)


def test_hf_round_trip_reproduces_every_tensor(mtp_fixture):
    root, cfg, _ = mtp_fixture
    assert_same_tensors(root / "hf", root / "back")
    exported = json.loads((root / "back" / "config.json").read_text())
    assert exported["num_nextn_predict_layers"] == 1
    assert model_config_from_hf(exported) == model_config_from_hf(cfg)


def test_mjax_round_trip_reproduces_every_parameter(mtp_fixture, tmp_path):
    root, cfg, _ = mtp_fixture
    src = tmp_path / "mjax"
    shutil.copytree(root / "mjax", src)
    meta = params_io.param_metadata(src)
    rng = np.random.default_rng(5)
    params = {p: rng.standard_normal(shape).astype(ml_dtypes.bfloat16 if dtype == np.dtype(ml_dtypes.bfloat16)
                                                    else dtype) for p, (shape, dtype) in meta.items()}
    params["embed/embedding"][cfg["vocab_size"]:] = 0  # the vocab padding is zero by definition (export drops it)
    params["lm_head/kernel"][:, cfg["vocab_size"]:] = 0
    shutil.rmtree(src / params_io.PARAMS)
    params_io.save_params(src, params_io.unflatten(params))
    mjax_to_hf(src, tmp_path / "hf", max_shard_bytes=100_000)
    hf_to_mjax(tmp_path / "hf", tmp_path / "back")
    back = _flat(tmp_path / "back")
    assert sorted(back) == sorted(params) and any(p.startswith("mtp/") for p in back)
    for p, a in params.items():
        assert (back[p].dtype, back[p].tobytes()) == (a.dtype, a.tobytes()), p


def test_a_copy_that_differs_from_the_shared_tensor_is_refused(tmp_path):
    cfg, tensors = _with_mtp_layer()
    name = f"model.layers.{cfg['num_hidden_layers']}.shared_head.head.weight"
    tensors[name] = (tensors[name].astype(np.float32) + 1).astype(tensors[name].dtype)
    _write(tmp_path / "hf", cfg, tensors)
    with pytest.raises(ConversionError, match=name.replace(".", r"\.")):
        hf_to_mjax(tmp_path / "hf", tmp_path / "mjax")


def test_without_num_nextn_predict_layers_the_mtp_tensors_have_no_place(tmp_path):
    cfg, tensors = _with_mtp_layer()
    _write(tmp_path / "hf", dict(cfg, num_nextn_predict_layers=0), tensors)
    with pytest.raises(ConversionError, match="have no place"):
        hf_to_mjax(tmp_path / "hf", tmp_path / "mjax")
