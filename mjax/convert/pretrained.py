"""`load_pretrained(path)`: a converted mjax checkpoint, a training checkpoint (`mjax-train --save`) or a
Hugging Face model directory -> (model, Config). What the path is is decided by mjax.convert.source."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from mjax.config import Config, ExecutionConfig, PrecisionConfig
from mjax.convert import source
from mjax.storage import params as params_io
from mjax.convert.spec import ConversionError, unflatten
from mjax.sharding import single_device


@dataclasses.dataclass
class Pretrained:
    """A model with its weights. `model(tokens)` maps int32 ids [batch, seq] to logits [batch, seq, vocab] with the
    vocab padding removed. `params` is the plain params dict of `model_def` (mjax.model.ModelDef)."""
    model_def: object
    params: dict
    config: Config

    def __post_init__(self):
        vocab, model_def = self.config.model.vocab_size, self.model_def
        self._apply = jax.jit(lambda p, t, pos, seg: model_def.apply(p, t, pos, seg)[..., :vocab])  # [B, T, V]

    @property
    def vocab_size(self) -> int:
        return self.config.model.vocab_size

    def __call__(self, tokens, positions=None, segment_ids=None):
        with single_device():
            return self._apply(self.params, jnp.asarray(tokens, jnp.int32), positions, segment_ids)


def load_pretrained(path, dtype: str = "float32", compute_dtype: str | None = None,
                    step: int | None = None, execution: ExecutionConfig | None = None) -> tuple[Pretrained, Config]:
    """Loads `path`: an mjax checkpoint written by `mjax-convert`, an `mjax-train --save` directory
    (its latest step unless `step`; the config saved with it) or an HF model directory with config.json +
    safetensors; or a `mjax.convert.source.Source`. Params are cast to `dtype`; the forward pass computes in
    `compute_dtype` (default: `dtype`) with the kernel choices of `execution` (default: the checkpoint's; auto for
    an HF directory). Returns (model, config)."""
    from mjax.convert.hf import base_config, params_from_hf  # noqa: PLC0415
    from mjax.model import build_model  # noqa: PLC0415

    found = path if isinstance(path, source.Source) else source.resolve(path, step, flag="--load")
    path = found.directory
    precision = dataclasses.replace(PrecisionConfig(), compute_dtype=compute_dtype or dtype, params_dtype=dtype)
    if found.kind != "hf":  # converted or training: the same params/ layout (mjax/storage/params.py)
        cfg = dataclasses.replace(found.config, precision=precision, execution=execution or found.config.execution)
        model_def = build_model(cfg.model, precision, cfg.execution)
        return Pretrained(model_def, params_io.restore(path, model_def.abstract_params()), cfg), cfg
    model_cfg, flat = params_from_hf(path)
    cfg = dataclasses.replace(base_config(dataclasses.asdict(model_cfg)), precision=precision,
                              execution=execution or ExecutionConfig())
    model_def = build_model(cfg.model, precision, cfg.execution)
    padded = model_def.vocab_size
    params = unflatten({p: jnp.asarray(params_io.fit_vocab(p, x, padded).astype(np.dtype(dtype)))
                        for p, x in flat.items()})
    want = jax.tree.map(lambda a: (a.shape, a.dtype), model_def.abstract_params())
    got = jax.tree.map(lambda a: (a.shape, a.dtype), params)
    if got != want:
        raise ConversionError(f"{path}: stored params do not match the model built from its config")
    return Pretrained(model_def, params, cfg), cfg
