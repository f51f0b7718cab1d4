"""Bad input fails with a clear error naming the tensor, key or architecture."""

import json
import shutil

import numpy as np
import pytest

from mjax.convert import ConversionError, hf_to_mjax, mjax_to_hf
from mjax.convert.hf import iter_params, model_config_from_hf
from mjax.convert.safetensors_io import SafetensorsWriter
from tests.convert_utils import FIXTURES, read_safetensors


def _copy(name, tmp_path, edit_config=None, edit_tensors=None):
    """A copy of a fixture as one model.safetensors, with its config and tensor dict edited."""
    out = tmp_path / name
    out.mkdir()
    cfg = json.loads((FIXTURES / name / "config.json").read_text())
    if edit_config:
        edit_config(cfg)
    (out / "config.json").write_text(json.dumps(cfg))
    tensors = read_safetensors(FIXTURES / name)
    if edit_tensors:
        edit_tensors(tensors)
    writer = SafetensorsWriter(out, [(k, v.shape, v.dtype) for k, v in tensors.items()])
    for k, v in tensors.items():
        writer.write(k, v)
    writer.close()
    return out


def _convert(directory):
    _, chunks = iter_params(directory)
    for _ in chunks:
        pass


def test_unsupported_architecture_is_named(tmp_path):
    d = _copy("llama_tied_mha", tmp_path, lambda c: c.update(architectures=["FalconForCausalLM"]))
    with pytest.raises(ConversionError, match="FalconForCausalLM.*not supported.*LlamaForCausalLM"):
        hf_to_mjax(d, tmp_path / "out")


def test_missing_tensor_is_named(tmp_path):
    d = _copy("llama_tied_mha", tmp_path, edit_tensors=lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ConversionError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' is missing"):
        _convert(d)


def test_shape_mismatch_names_tensor_and_shapes(tmp_path):
    d = _copy("mistral_swa", tmp_path, lambda c: c.update(intermediate_size=128))
    with pytest.raises(ConversionError, match=r"'model\.layers\.0\.mlp\.gate_proj\.weight' has shape \[96, 64\], "
                                              r"expected \[128, 64\]"):
        _convert(d)


def test_unexpected_tensor_is_named(tmp_path):
    d = _copy("qwen2_tied", tmp_path, edit_tensors=lambda t: t.update(
        {"model.layers.0.self_attn.o_proj.bias": np.zeros(64, np.float32)}))
    with pytest.raises(ConversionError, match=r"no place in the qwen2 mapping.*o_proj\.bias"):
        _convert(d)


def test_tied_checkpoint_may_carry_lm_head_and_gpt2_mask_buffers(tmp_path):
    """HF ties lm_head to the embedding (a stored copy is ignored); old GPT-2 files carry attn.bias buffers."""
    d = _copy("gpt2", tmp_path, edit_tensors=lambda t: t.update({
        "lm_head.weight": t["transformer.wte.weight"], "transformer.h.0.attn.bias": np.ones((1, 1, 4, 4), np.float32),
        **{k[len("transformer."):]: t.pop(k) for k in list(t) if k.startswith("transformer.h.1.")}}))
    _convert(d)  # also reads names saved without the "transformer." prefix


@pytest.mark.parametrize("name, edit, match", [
    ("llama3_gqa", lambda c: c["rope_scaling"].update(rope_type="yarn"), "rope scaling type 'yarn'"),
    ("llama_tied_mha", lambda c: c.update(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
    ("llama_tied_mha", lambda c: c.update(attention_bias=True), "attention_bias=True is not supported"),
    ("gpt2", lambda c: c.update(activation_function="relu"), "activation_function='relu'"),
    ("qwen2_tied", lambda c: c.update(layer_types=["full_attention", "sliding_attention"], sliding_window=4),
     "mix full and sliding-window"),
    ("llama_tied_mha", lambda c: c.pop("num_hidden_layers"), "no 'num_hidden_layers'"),
])
def test_unsupported_config_is_named(name, edit, match):
    cfg = json.loads((FIXTURES / name / "config.json").read_text())
    edit(cfg)
    with pytest.raises(ConversionError, match=match):
        model_config_from_hf(cfg)


def test_not_a_model_directory(tmp_path):
    with pytest.raises(ConversionError, match="no config.json"):
        hf_to_mjax(tmp_path, tmp_path / "out")
    shutil.copy(FIXTURES / "gpt2" / "config.json", tmp_path / "config.json")
    with pytest.raises(ConversionError, match="no model.safetensors"):
        hf_to_mjax(tmp_path, tmp_path / "out")
    with pytest.raises(ConversionError, match="not an mjax checkpoint"):
        mjax_to_hf(tmp_path, tmp_path / "out")


def test_export_to_an_incompatible_architecture(tmp_path):
    hf_to_mjax(FIXTURES / "qwen2_tied", tmp_path / "m")
    with pytest.raises(ConversionError, match=r"model.add_qkv_bias=True as LlamaForCausalLM"):
        mjax_to_hf(tmp_path / "m", tmp_path / "h", architecture="LlamaForCausalLM")
    with pytest.raises(ConversionError, match="--architecture=BertModel is not supported"):
        mjax_to_hf(tmp_path / "m", tmp_path / "h", architecture="BertModel")


def test_export_never_writes_over_an_existing_model(tmp_path):
    """A second export into the same --output would leave stale shards that loaders pick over the new ones."""
    out = _copy("llama_tied_mha", tmp_path)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ConversionError, match=r"already holds a model \(model.safetensors\)"):
        SafetensorsWriter(out, [("x", (2,), np.dtype(np.float32))])
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
