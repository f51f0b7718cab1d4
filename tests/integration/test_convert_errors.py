"""Bad input fails with a clear error naming the tensor, key or architecture."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mjax.config import ModelConfig
from mjax.convert import ConversionError, hf_to_mjax, mjax_to_hf
from mjax.convert.hf import iter_params, model_config_from_hf
from mjax.convert.safetensors_io import SafetensorsWriter
from tests.helpers.convert_utils import FIXTURES, read_safetensors


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
    # mixtures of experts
    ("mixtral", lambda c: c.update(router_jitter_noise=0.1), "Mixtral: config.json router_jitter_noise=0.1 is not"),
    ("mixtral", lambda c: c.pop("num_local_experts"), "Mixtral config.json has no 'num_local_experts'"),
    ("qwen2_moe", lambda c: c.update(mlp_only_layers=[0, 1, 2]), "mlp_only_layers / decoder_sparse_step make every "
                                                                 "layer dense"),
    ("qwen2_moe", lambda c: c.pop("shared_expert_intermediate_size"), "no 'shared_expert_intermediate_size'"),
    ("qwen2_moe", lambda c: c.update(layer_types=["full_attention", "sliding_attention", "full_attention"],
                                     sliding_window=4), "Qwen2-MoE: layer_types .* mix full and sliding-window"),
    ("qwen3_moe", lambda c: c.update(attention_bias=True), "Qwen3-MoE: config.json attention_bias=True"),
    ("qwen3_moe", lambda c: c.update(use_sliding_window=True, sliding_window=8), "use_sliding_window=True"),
    ("olmoe", lambda c: c.update(clip_qkv=8.0), "OLMoE: config.json clip_qkv=8.0 is not supported"),
    ("olmoe", lambda c: c.update(head_dim=32), "head_dim=32 is not hidden_size / num_attention_heads"),
    ("olmoe", lambda c: c.update(hidden_act="gelu"), "OLMoE: config.json hidden_act='gelu'"),
])
def test_unsupported_config_is_named(name, edit, match):
    cfg = json.loads((FIXTURES / name / "config.json").read_text())
    edit(cfg)
    with pytest.raises(ConversionError, match=match):
        model_config_from_hf(cfg)


DEEPSEEK = {"architectures": ["DeepseekForCausalLM"], "model_type": "deepseek", "hidden_size": 64,
            "intermediate_size": 96, "moe_intermediate_size": 16, "num_attention_heads": 4, "num_hidden_layers": 3,
            "vocab_size": 300, "n_routed_experts": 4, "num_experts_per_tok": 2, "first_k_dense_replace": 1}


@pytest.mark.parametrize("edit, match", [
    (dict(scoring_func="sigmoid"), "DeepSeek-MoE: config.json scoring_func='sigmoid' is not supported"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling=.*is not supported"),
    (dict(first_k_dense_replace=3), "first_k_dense_replace=3 / moe_layer_freq=1 make every layer dense"),
    (dict(n_routed_experts=None), "no 'n_routed_experts'"),
    (dict(head_dim=32), "head_dim=32: DeepSeek's attention uses hidden_size / num_attention_heads"),
])
def test_unsupported_deepseek_config_is_named(edit, match):
    model_config_from_hf(DEEPSEEK)  # the base config converts
    with pytest.raises(ConversionError, match=match):
        model_config_from_hf(dict(DEEPSEEK, **edit))


def _moe_model(**fields):
    base = dict(num_layers=3, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, vocab_size=300,
                num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16)
    return ModelConfig(**{**base, **fields})


@pytest.mark.parametrize("arch, fields, match", [
    ("MixtralForCausalLM", dict(num_experts=None), "cannot write a dense model"),
    ("MixtralForCausalLM", dict(moe_router_pre_softmax=True), "moe_router_pre_softmax=True as MixtralForCausalLM"),
    ("MixtralForCausalLM", dict(moe_layer_freq="[1,0,1]"), r"cannot write dense layers \(--moe_layer_freq=\[1,0,1\]"),
    ("MixtralForCausalLM", dict(moe_router_score_function="sigmoid"), "moe_router_score_function='sigmoid'"),
    ("MixtralForCausalLM", dict(moe_router_topk_scaling_factor=2.5), "moe_router_topk_scaling_factor=2.5"),
    ("Qwen2MoeForCausalLM", dict(moe_shared_expert_intermediate_size=32), "moe_shared_expert_gate=False"),
    ("Qwen3MoeForCausalLM", dict(), "model.qk_layernorm=False as Qwen3MoeForCausalLM"),
    ("OlmoeForCausalLM", dict(qk_layernorm=True), "qk_layernorm_across_heads=False as OlmoeForCausalLM"),
    ("DeepseekForCausalLM", dict(moe_layer_freq="[0,1,1,0,1]", num_layers=5), r"layer pattern \[0, 1, 1, 0, 1\]"),
    ("DeepseekForCausalLM", dict(moe_router_topk=1), "moe_router_pre_softmax=False with --moe_router_topk=1"),
    ("DeepseekForCausalLM", dict(moe_shared_expert_intermediate_size=40), "n_shared_experts \\* moe_intermediate"),
    ("DeepseekForCausalLM", dict(moe_router_num_groups=2, moe_router_group_topk=1), "moe_router_num_groups=2"),
])
def test_moe_config_the_architecture_cannot_express_is_named(arch, fields, match):
    from mjax.convert.hf import FAMILIES

    with pytest.raises(ConversionError, match=match):
        FAMILIES[arch].config_to_hf(_moe_model(**fields))


def test_moe_export_to_an_incompatible_architecture_writes_nothing(tmp_path):
    """Qwen2-MoE (not renormalised, a dense layer, shared experts) as Mixtral, Qwen3-MoE or the dense Qwen2: refused,
    naming the setting, before any tensor is written."""
    hf_to_mjax(FIXTURES / "qwen2_moe", tmp_path / "m")
    with pytest.raises(ConversionError, match=r"model.moe_router_pre_softmax=True as MixtralForCausalLM"):
        mjax_to_hf(tmp_path / "m", tmp_path / "h", architecture="MixtralForCausalLM")
    with pytest.raises(ConversionError, match="model.qk_layernorm=False as Qwen3MoeForCausalLM"):
        mjax_to_hf(tmp_path / "m", tmp_path / "h", architecture="Qwen3MoeForCausalLM")
    with pytest.raises(ConversionError, match=r"model.num_experts=4 as Qwen2ForCausalLM \(it needs None\)"):
        mjax_to_hf(tmp_path / "m", tmp_path / "h", architecture="Qwen2ForCausalLM")
    assert not (tmp_path / "h").exists() or not any((tmp_path / "h").iterdir())


def test_not_a_model_directory(tmp_path):
    with pytest.raises(ConversionError, match="is not a checkpoint: expected config.json"):
        hf_to_mjax(tmp_path, tmp_path / "out")
    shutil.copy(FIXTURES / "gpt2" / "config.json", tmp_path / "config.json")
    with pytest.raises(ConversionError, match="no model.safetensors"):
        hf_to_mjax(tmp_path, tmp_path / "out")
    with pytest.raises(ConversionError, match="is a Hugging Face model directory"):
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


# ---- the scripts: one line naming the flag or file, no traceback, exit code 2 (bad input) or 4 (checkpoint) ----

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1", PYTHONPATH=str(ROOT))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A converted checkpoint, a directory that is no checkpoint, and a path that does not exist."""
    root = tmp_path_factory.mktemp("inputs")
    hf_to_mjax(FIXTURES / "llama_tied_mha", root / "converted")
    (root / "notes").mkdir()
    (root / "notes" / "readme.txt").write_text("not a model")
    return {"converted": root / "converted", "notes": root / "notes", "missing": root / "missing",
            "out": root / "out"}


CASES = [  # (script, flags with {placeholders}, exit code, text the error line names)
    ("convert_checkpoint.py", ["--direction=mjax_to_hf", "--input={missing}", "--output={out}"], 2,
     "--input={missing} does not exist"),
    ("convert_checkpoint.py", ["--direction=hf_to_mjax", "--input={missing}", "--output={out}"], 2,
     "--input={missing} does not exist"),
    ("convert_checkpoint.py", ["--direction=sideways", "--input={converted}", "--output={out}"], 2, "--direction"),
    ("convert_checkpoint.py", ["--direction=mjax_to_hf", "--input={converted}", "--output={out}",
                               "--architecture=BertModel"], 2, "--architecture=BertModel is not supported"),
    ("convert_checkpoint.py", ["--direction=hf_to_mjax", f"--input={FIXTURES / 'gpt2'}", "--output={converted}"], 2,
     "--output={converted} already holds params/"),
    ("convert_checkpoint.py", ["--direction=mjax_to_hf", "--input={notes}", "--output={out}"], 4,
     "--input={notes} is not a checkpoint"),
    ("convert_checkpoint.py", ["--direction=hf_to_mjax", "--input={converted}", "--output={out}"], 2,
     "--direction=mjax_to_hf converts it"),
    ("generate.py", ["--load={missing}", "--prompt_ids=1"], 2, "--load={missing} does not exist"),
    ("generate.py", ["--load={notes}", "--prompt_ids=1"], 4, "--load={notes} is not a checkpoint"),
    ("generate.py", ["--load={converted}", "--prompt_ids=1,x"], 2, "--prompt_ids=1,x: not a list of integers"),
    ("generate.py", ["--load={converted}", "--prompt_ids=1,100000"], 2, "[100000] outside the model's vocab"),
]


@pytest.mark.parametrize("script, args, code, text", CASES, ids=[f"{c[0]}:{c[3][:40]}" for c in CASES])
def test_script_errors_are_one_line_with_the_exit_code(inputs, script, args, code, text):
    args, text = [a.format(**inputs) for a in args], text.format(**inputs)
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args], env=ENV, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == code, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = [ln for ln in out.stderr.splitlines() if text in ln]
    assert len(lines) == 1, out.stderr[-3000:]
    assert not (inputs["out"] / "config.json").exists()  # nothing written
