"""Hugging Face <-> mjax: config translation, streamed tensor conversion driven by a family's table, and the two
directory-level conversions (`hf_to_mjax`, `mjax_to_hf`).

Import walks the table rule by rule: for a per-layer rule it allocates the stacked mjax array(s) ([layers of the
stack, ...], or [layers, experts, ...] for a per-expert rule) and fills them one HF tensor at a time, then hands them
to the writer and drops them. Export does the reverse, one stacked mjax parameter at a time. Every tensor's shape,
and the HF config, are checked before anything is written.
"""

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import numpy as np

from mjax.config import Config, ConfigError, ModelConfig
from mjax.convert import source, tokenizer
from mjax.storage import params as params_io
from mjax.convert.deepseek import DEEPSEEK_V2, DEEPSEEK_V3, MLA_FAMILIES
from mjax.convert.fp8_blocks import DequantizingReader, fp8_block_size
from mjax.convert.gpt2 import GPT2
from mjax.convert.llama import LLAMA, MISTRAL, QWEN2
from mjax.convert.moe import DEEPSEEK_MOE, MIXTRAL, MOE_FAMILIES, OLMOE, QWEN2_MOE, QWEN3_MOE
from mjax.convert.safetensors_io import SafetensorsReader, SafetensorsWriter
from mjax.convert.spec import ConversionError, Dims, Family, InputError, flatten

log = logging.getLogger(__name__)
FAMILIES: dict[str, Family] = {a: f for f in (LLAMA, MISTRAL, QWEN2, GPT2, *MOE_FAMILIES, *MLA_FAMILIES)
                               for a in f.architectures}
MODEL_TYPES = {"llama": LLAMA, "mistral": MISTRAL, "qwen2": QWEN2, "gpt2": GPT2, "mixtral": MIXTRAL,
               "qwen2_moe": QWEN2_MOE, "qwen3_moe": QWEN3_MOE, "olmoe": OLMOE, "deepseek": DEEPSEEK_MOE,
               "deepseek_v2": DEEPSEEK_V2, "deepseek_v3": DEEPSEEK_V3}
# HF keys the families write; an original config's other keys (bos/eos ids, ...) are carried through on export.
MANAGED = ("rope_theta", "rope_scaling", "rope_parameters", "layer_types", "torch_dtype", "dtype", "architectures",
           "quantization_config")  # export writes no FP8 (mjax/convert/fp8_blocks.py)


def read_hf_config(directory) -> dict:
    path = Path(directory) / "config.json"
    if not path.exists():
        raise ConversionError(f"{directory} has no config.json: not a Hugging Face model directory")
    return json.loads(path.read_text())


def family_for(hf: dict) -> Family:
    archs = hf.get("architectures") or []
    for arch in archs:
        if arch in FAMILIES:
            return FAMILIES[arch]
    if archs:
        raise ConversionError(f"architecture {archs[0]!r} is not supported; supported: {', '.join(FAMILIES)}")
    if hf.get("model_type") in MODEL_TYPES:
        return MODEL_TYPES[hf["model_type"]]
    raise ConversionError(f"config.json names no architecture (model_type {hf.get('model_type')!r}); supported: "
                          f"{', '.join(FAMILIES)}")


def base_config(model_fields: dict) -> Config:
    """Default Config around a converted model (sequence length capped by a learned position table)."""
    seq = min(Config().train.seq_length, model_fields.get("max_position_embeddings") or 1 << 30)
    return Config().replace(model=model_fields, train={"seq_length": seq})


def model_config_from_hf(hf: dict) -> ModelConfig:
    fields = family_for(hf).config_from_hf(hf)
    try:
        cfg = base_config(fields)
        cfg.validate()
    except ConfigError as e:
        raise ConversionError(f"the HF config gives an invalid mjax model: {e}") from e
    return cfg.model


def param_shapes(model_cfg) -> dict:
    from mjax.model import build_model  # noqa: PLC0415

    return {p: tuple(x.shape) for p, x in flatten(build_model(model_cfg).abstract_params()).items()}


def _layer_shapes(rule, shapes) -> tuple:  # the shapes of one HF tensor's mjax slices
    return tuple(shapes[p][rule.stacked_axes:] for p in rule.mjax)


def plan_import(reader: SafetensorsReader, family: Family, model_cfg) -> list:
    """[(rule, [(index into the stacked arrays, HF name in the file)])] after checking every name and shape;
    unexpected tensors are an error too. A repeated rule's names are the copies to check against the tensor they
    copy, its index (row,) each."""
    shapes, dims = param_shapes(model_cfg), Dims.of(model_cfg)
    plan, used = [], set()
    for r in family.active_rules(shapes):
        want = r.transform.hf_shape(_layer_shapes(r, shapes), dims)
        names = []
        for index, name in family.hf_tensors(r, dims):
            found = _resolve(reader, family, name)
            if found is None:
                raise ConversionError(f"tensor {name!r} is missing from {reader.directory} (needed for "
                                      f"{', '.join(r.mjax)}; the {family.name} config expects it)")
            if reader.shape(found) != want:
                raise ConversionError(f"tensor {found!r} has shape {list(reader.shape(found))}, expected "
                                      f"{list(want)} from config.json (mjax {', '.join(r.mjax)})")
            names.append((index, found))
            used.add(found)
        plan.append((r, names))
    ignorable = family.ignore + (() if model_cfg.untie_embeddings_and_output_weights else (family.tied_output,))
    extra = [n for n in reader.names() if n not in used and not n.endswith(ignorable)]
    if extra:
        raise ConversionError(f"{len(extra)} tensor(s) in {reader.directory} have no place in the {family.name} "
                              f"mapping (is config.json right?): {', '.join(sorted(extra)[:8])}")
    return plan


def _resolve(reader, family, name):
    if name in reader:
        return name
    for prefix in family.strip_prefixes:
        if name.startswith(prefix) and name[len(prefix):] in reader:
            return name[len(prefix):]
    return None


def iter_params(directory, dtype=None):
    """(ModelConfig, generator of flat {mjax path: np.ndarray} chunks); one rule's stacked tensors per chunk.

    dtype: None keeps each tensor's stored dtype; else e.g. "float32"/"bfloat16".
    """
    hf = read_hf_config(directory)
    family = family_for(hf)
    model_cfg = model_config_from_hf(hf)
    reader = SafetensorsReader(directory)
    block = fp8_block_size(hf)
    if block:  # FP8 weights with block scales (DeepSeek-V3): read dequantised to bf16
        reader = DequantizingReader(reader, block)
    plan = plan_import(reader, family, model_cfg)  # every check happens before the first read
    dims = Dims.of(model_cfg)
    shapes = param_shapes(model_cfg)

    copied = {r.mjax: names[0][1] for r, names in plan if not r.per_layer}  # whole-model param -> its HF tensor

    def chunks():
        for r, names in plan:
            if r.repeated_in is not None:  # copies of a whole-model tensor: they must be the tensor itself
                _check_copies(reader, copied[r.mjax], [name for _, name in names])
                continue
            out = None
            for index, name in names:
                parts = r.transform.to_mjax(reader.get(name), dims)
                if dtype is not None:
                    parts = tuple(p.astype(dtype) for p in parts)
                if not r.per_layer:  # contiguous: Orbax writes a strided view far slower and via a copy
                    out = {p: np.ascontiguousarray(x) for p, x in zip(r.mjax, parts)}
                    break
                if out is None:  # stacked [L, ...] / [L, E, ...] buffers, filled one HF tensor at a time
                    out = {p: np.empty(shapes[p][:r.stacked_axes] + x.shape, x.dtype) for p, x in zip(r.mjax, parts)}
                for p, x in zip(r.mjax, parts):
                    out[p][index] = x
            yield out

    return model_cfg, chunks()


def _check_copies(reader, original: str, copies: list[str]) -> None:
    if not copies:
        return
    want = reader.get(original)
    for name in copies:
        if not np.array_equal(reader.get(name), want):
            raise ConversionError(f"tensor {name!r} differs from {original!r}: mjax's multi-token prediction shares "
                                  "the model's embedding and output layer (as DeepSeek-V3 trains them), so the copy "
                                  "must equal it")


def hf_to_mjax(input_dir, output_dir, dtype=None) -> dict:
    """Converts an HF model directory into an mjax params-only checkpoint (layout: mjax.storage.params)."""
    src = source.resolve(input_dir)
    if src.kind != "hf":
        raise InputError(f"--input={input_dir} is an mjax checkpoint ({src.kind}), not a Hugging Face model "
                         "directory; --direction=mjax_to_hf converts it")
    output = Path(output_dir)
    model_cfg, chunks = iter_params(input_dir, dtype)
    output.mkdir(parents=True, exist_ok=True)
    nbytes = params_io.save_params_streaming(output, chunks)
    params_io.write_json(output / params_io.CONFIG, base_config(dataclasses.asdict(model_cfg)).to_dict())
    shutil.copy(Path(input_dir) / "config.json", output / params_io.HF_CONFIG)
    tok = tokenizer.find(src)
    if tok:
        tokenizer.copy(tok, output)
    return {"model": model_cfg.name, "bytes": nbytes}


def infer_family(m) -> Family:
    if m.multi_latent_attention:
        return DEEPSEEK_V3 if m.moe_router_score_function == "sigmoid" else DEEPSEEK_V2
    if m.num_experts:
        if m.qk_layernorm:
            return OLMOE if m.qk_layernorm_across_heads else QWEN3_MOE
        if m.moe_shared_expert_gate or m.add_qkv_bias:
            return QWEN2_MOE
        if m.moe_shared_expert_intermediate_size or not all(m.moe_layer_pattern()):
            return DEEPSEEK_MOE
        return MIXTRAL
    if m.position_embedding_type == "learned":
        return GPT2
    if m.add_qkv_bias:
        return QWEN2
    return MISTRAL if m.window_size else LLAMA


def hf_config_for(m, family: Family, original: dict | None, dtype) -> dict:
    generated = family.config_to_hf(m, original)
    base = {k: v for k, v in (original or {}).items() if k not in MANAGED}
    if original and family_for(original) is not family:
        base = {}  # a different architecture: the original's keys may not apply
    return {**base, **generated, "vocab_size": m.vocab_size, "torch_dtype": str(np.dtype(dtype))}


def _read_layers(stores: dict, r, layers: int, slabs: int = 4, copies=((),)):
    """Yields (index into the stacked arrays, mjax slices for one HF tensor) of one rule. A stacked parameter is
    read in `slabs` slabs of layers: tensorstore reads a whole stored chunk (here the whole stacked array) for any
    slice, so each slab read costs one pass over it while host memory stays at the array plus one slab (not twice
    the array). A per-expert rule yields each expert of each layer of the slab; a whole-model parameter is read
    once and yielded at each index of `copies` (a repeated rule's copies)."""
    if not r.stacked_axes:
        whole = tuple(np.asarray(s.read().result()) for s in stores.values()) if copies else ()
        for index in copies:
            yield index, whole
        return
    step = -(-layers // slabs)
    for start in range(0, layers, step):
        slab = [np.asarray(s[start:start + step].read().result()) for s in stores.values()]  # [k, ...] each
        for row in range(slab[0].shape[0]):
            if not r.per_expert:
                yield (start + row,), tuple(x[row] for x in slab)
                continue
            for j in range(slab[0].shape[1]):
                yield (start + row, j), tuple(x[row, j] for x in slab)
        del slab


def mjax_to_hf(input_dir, output_dir, dtype=None, architecture: str | None = None,
               max_shard_bytes: int = 5 << 30, step: int | None = None, with_tokenizer: bool = True) -> dict:
    """Converts an mjax checkpoint into an HF directory that transformers loads: a converted one (config.json +
    params/) or a training checkpoint of mjax-train --save (latest step unless `step`). The tokenizer the
    checkpoint goes with is written beside it unless not `with_tokenizer` (mjax/convert/tokenizer.py)."""
    found = source.resolve(input_dir, step)
    if found.kind == "hf":
        raise InputError(f"--input={input_dir} is a Hugging Face model directory; --direction=hf_to_mjax converts it")
    tok = tokenizer.find(found) if with_tokenizer else None  # before the tensors: a tokenizer problem fails fast
    cfg, src = found.config, found.directory
    output = Path(output_dir)
    m = cfg.model
    original = json.loads((src / params_io.HF_CONFIG).read_text()) if (src / params_io.HF_CONFIG).exists() else None
    if architecture:
        if architecture not in FAMILIES:
            raise InputError(f"--architecture={architecture} is not supported; supported: {', '.join(FAMILIES)}")
        family = FAMILIES[architecture]
    else:
        family = family_for(original) if original else infer_family(m)
    meta = params_io.param_metadata(src)  # ConversionError when unreadable
    shapes = {p: s for p, (s, _) in meta.items()}
    want = param_shapes(m)
    for p, s in want.items():  # the stored vocab padding may differ; everything else must match
        if p in shapes and p not in params_io.VOCAB_AXES and shapes[p] != s:
            raise ConversionError(f"parameter {p!r}: checkpoint has shape {shapes[p]}, config.json implies {s}")
    dims = dataclasses.replace(Dims.of(m), vp=shapes.get("embed/embedding", (0,))[0])
    out_dtype = lambda r: np.dtype(dtype) if dtype else meta[r.mjax[0]][1]  # noqa: E731
    # What the architecture cannot express fails here, naming the setting, before the table and any write.
    hf_config = hf_config_for(m, family, original, np.dtype(dtype) if dtype else meta["embed/embedding"][1])
    rules = family.active_rules(want)
    names = {r: dict(family.hf_tensors(r, dims)) for r in rules}  # {rule: {index: HF name}}
    plan = [(name, r.transform.hf_shape(_layer_shapes(r, shapes), dims), out_dtype(r))
            for r in rules for name in names[r].values()]
    output.mkdir(parents=True, exist_ok=True)
    writer = SafetensorsWriter(output, plan, max_shard_bytes)
    stores = params_io.open_params(src, [p for r in rules for p in r.mjax])  # lazy: one slab of layers at a time
    for r in rules:
        layers = shapes[r.mjax[0]][0] if r.stacked_axes else 0
        for index, parts in _read_layers({p: stores[p] for p in r.mjax}, r, layers, copies=list(names[r])):
            writer.write(names[r][index], np.ascontiguousarray(r.transform.to_hf(parts, dims)).astype(
                out_dtype(r), copy=False))
    writer.close()
    written = tokenizer.write(tok, output, m.max_position_embeddings or cfg.train.seq_length) if tok else []
    if tok and "eos_token_id" not in hf_config and tok.eos_id() is not None:  # generate() stops there
        hf_config["eos_token_id"] = tok.eos_id()
    params_io.write_json(output / "config.json", hf_config)
    if with_tokenizer and not tok:
        log.warning("no tokenizer written: %s holds no tokenizer files", found.describe())
    return {"architecture": family.architectures[0], "tensors": len(plan), "bytes": writer.total,
            "files": writer.files, "tokenizer": written}


def params_from_hf(directory, dtype=None) -> tuple[ModelConfig, dict]:
    """The whole model in memory as a flat {path: np.ndarray} (load_pretrained on an HF directory)."""
    model_cfg, chunks = iter_params(directory, dtype)
    flat = {}
    for chunk in chunks:
        flat.update(chunk)
    return model_cfg, flat


__all__ = ["ConversionError", "hf_to_mjax", "iter_params", "mjax_to_hf", "model_config_from_hf", "params_from_hf"]
