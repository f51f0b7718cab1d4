"""Params-only mjax checkpoints, written tensor group by tensor group so host memory stays near one stacked tensor.

Layout of a converted checkpoint directory `<dir>` (what `--load_params_only` must accept):

    <dir>/config.json       `Config.to_dict()` (model section from the HF config; other sections are defaults)
    <dir>/params/           an Orbax PyTree checkpoint (OCDBT, zarr3) of the plain params dict, exactly the tree
                            `build_model(cfg.model).abstract_params()` describes: {"embed": {"embedding": ...},
                            "layers": {"attn": {"q_proj": {"kernel": [L, D, N, H]}, ...}}, ...}. Leaves are numpy
                            arrays in the checkpoint's dtype (the HF dtype, e.g. bfloat16, unless --dtype chose one);
                            cast to params_dtype on restore. Vocab tables are padded to
                            `model.padded_vocab_size()` with zero rows (`restore` below pads or trims the vocab
                            axis of `embed/embedding` and `lm_head/kernel` if a run pads differently).
                            Read it with `ocp.StandardCheckpointer().restore(<dir>/params, abstract_params)` or
                            `ocp.PyTreeCheckpointer().restore(<dir>/params)`; no step directory, no optimizer state.
    <dir>/hf_config.json    the source HF config.json (kept so that export writes back the same extra keys)
    <dir>/tokenizer*.json, vocab/merges files, generation_config.json: copied from the HF directory

Streaming uses Orbax's partial save (`orbax.checkpoint.experimental.v1.partial`): each call adds a few stacked
tensors to a staging checkpoint, `finalize` commits it, and the PyTree directory is moved to `<dir>/params`.
"""

import contextlib
import json
import logging
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

import jax
import numpy as np

from mjax.storage import ConversionError, InputError, flatten, unflatten

log = logging.getLogger(__name__)
PARAMS = "params"
CONFIG = "config.json"
HF_CONFIG = "hf_config.json"
VOCAB_AXES = {"embed/embedding": 0, "lm_head/kernel": 1}


def _ocp():
    import orbax.checkpoint as ocp  # noqa: PLC0415  (heavy; only when reading or writing)

    return ocp


def is_mjax_checkpoint(directory) -> bool:
    d = Path(directory)
    if not (d / CONFIG).exists() or not (d / PARAMS).is_dir():
        return False
    return "model" in json.loads((d / CONFIG).read_text())


def save_params_streaming(directory, chunks: Iterable[dict]) -> int:
    """Writes `<directory>/params` from an iterable of flat {path: np.ndarray} dicts (disjoint); returns bytes."""
    directory = Path(directory).absolute()  # Orbax wants absolute paths
    target, staging = directory / PARAMS, directory / "params_staging"
    if target.exists():
        raise InputError(f"--output={directory} already holds params/; remove it or choose another --output")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.rmtree(staging.with_name(staging.name + ".partial_save"), ignore_errors=True)
    try:
        from orbax.checkpoint.experimental.v1 import partial  # noqa: PLC0415
    except ImportError:  # an Orbax without partial saves: correct, but holds the whole model once
        log.warning("this Orbax has no partial save; writing the params in one piece (more host memory)")
        tree = {}
        for chunk in chunks:
            tree.update(chunk)
        save_params(directory, unflatten(tree))
        return sum(x.nbytes for x in tree.values())
    total = 0
    with _streaming_context():
        for chunk in chunks:
            partial.save(staging, unflatten(chunk))
            total += sum(x.nbytes for x in chunk.values())
            del chunk
        partial.finalize(staging)
    (staging / "state").rename(target)  # the PyTree directory of the v1 layout
    shutil.rmtree(staging)
    _write_v0_metadata(target)
    return total


def _streaming_context():
    """Options that keep host memory at one copy of each chunk and the write fast:
    - no defensive deep copy of the host arrays (each chunk is ours and dropped after its save);
    - one zarr chunk per array even above Orbax's 2 GiB default file size, where tensorstore would otherwise copy
      the whole array into chunk buffers (docs/convert.md);
    - no zstd (much slower on a small CPU for little size gained, docs/convert.md; readers handle both)."""
    from orbax.checkpoint.experimental import v1  # noqa: PLC0415

    opts = v1.options
    try:
        saving = opts.ArrayOptions.Saving(use_compression=False, ocdbt_target_data_file_size=1 << 40)
        return v1.Context(array_options=opts.ArrayOptions(saving=saving),
                          memory_options=opts.MemoryOptions(deepcopy_host_arrays=False))
    except (AttributeError, TypeError) as e:  # an older Orbax: correct, with more memory and time
        log.warning("this Orbax lacks a streaming option (%s); conversion will use more host memory", e)
        return contextlib.nullcontext()


def _write_v0_metadata(target: Path):
    """The two small files a direct `PyTreeCheckpointer().save(target, ...)` leaves, so readers see no difference."""
    handler = _ocp().PyTreeCheckpointHandler
    now = time.time_ns()
    write_json(target / "_CHECKPOINT_METADATA", {
        "item_handlers": f"{handler.__module__}.{handler.__qualname__}", "metrics": {}, "performance_metrics": {},
        "init_timestamp_nsecs": now, "commit_timestamp_nsecs": now, "custom_metadata": {}})
    (target / "commit_success.txt").write_text(f"Checkpoint commit was successful to {target}")


def save_params(directory, params: dict):
    """Writes `<directory>/params` in one call (small models and tests)."""
    _ocp().PyTreeCheckpointer().save(Path(directory).absolute() / PARAMS, params)


def param_metadata(directory) -> dict:
    """{path: (shape, dtype)} of the stored params, read from the checkpoint metadata only."""
    root = Path(directory).absolute() / PARAMS
    try:
        meta = _ocp().PyTreeCheckpointer().metadata(root)
    except Exception as e:  # Orbax raises many types for a missing or damaged item; all mean the same here
        raise ConversionError(f"{root}: cannot read the checkpoint's metadata ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:300] if str(e) else ''})") from e
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    return {k: (tuple(v.shape), np.dtype(v.dtype)) for k, v in flatten(dict(tree)).items()}


def read_params(directory, paths: Iterable[str] | None = None) -> dict:
    """Flat {path: np.ndarray} of the stored params (only `paths` when given: one stacked tensor at a time)."""
    ocp = _ocp()
    meta = param_metadata(directory)
    paths = list(meta if paths is None else paths)
    for p in paths:
        if p not in meta:
            raise ConversionError(f"parameter {p!r} is missing from the checkpoint {directory}/{PARAMS}")
    item = unflatten({p: np.empty(0, meta[p][1]) for p in paths})
    restore_args = jax.tree.map(lambda x: ocp.RestoreArgs(restore_type=np.ndarray), item)
    out = ocp.PyTreeCheckpointer().restore(
        Path(directory).absolute() / PARAMS,
        args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True))
    return {p: np.asarray(v) for p, v in flatten(out).items()}


def open_params(directory, paths: Iterable[str]) -> dict:
    """{path: tensorstore.TensorStore} opened lazily on the stored params: `store[i].read().result()` reads layer i
    alone, so exporting a stacked [L, ...] parameter holds one layer in memory, not L (Orbax's restore of a whole
    leaf peaks at twice its size). The read spec is Orbax's own, so any layout Orbax wrote opens."""
    import tensorstore as ts  # noqa: PLC0415

    ocp = _ocp()
    root = Path(directory).absolute() / PARAMS
    meta = ocp.PyTreeCheckpointer().metadata(root)
    tree = getattr(meta, "item_metadata", meta)
    leaves = flatten(dict(getattr(tree, "tree", tree)))
    zarr3 = getattr(tree, "use_zarr3", True)
    context = ocp.type_handlers.get_ts_context(use_ocdbt=True)
    out = {}
    for p in paths:
        if p not in leaves:
            raise ConversionError(f"parameter {p!r} is missing from the checkpoint {root}")
        info = ocp.type_handlers.ParamInfo(name=leaves[p].name, parent_dir=root, is_ocdbt_checkpoint=True,
                                           use_zarr3=zarr3)
        spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=True)
        out[p] = ts.open(spec, open=True, read=True, context=context).result()
    return out


def fit_vocab(path: str, x, padded: int):
    """Pads (zeros) or trims the vocab axis of an embedding/output table to `padded` rows."""
    axis = VOCAB_AXES.get(path)
    if axis is None or x.shape[axis] == padded:
        return x
    if x.shape[axis] > padded:
        return x[(slice(None),) * axis + (slice(0, padded),)]
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, padded - x.shape[axis])
    return np.pad(np.asarray(x), widths)


def restore(directory, abstract_params: dict) -> dict:
    """The params as jax Arrays matching `abstract_params` (ShapeDtypeStructs, with shardings if set): dtype cast,
    vocab padding adapted. Leaves whose stored shape already matches are restored by Orbax straight onto their
    shardings; a vocab table padded differently goes through host memory once."""
    ocp = _ocp()
    meta = param_metadata(directory)
    single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    flat = {p: a if getattr(a, "sharding", None) is not None else
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=single) for p, a in flatten(abstract_params).items()}
    missing = sorted(set(flat) - set(meta))
    if missing:
        raise ConversionError(f"{directory}/{PARAMS} lacks parameter(s) {', '.join(missing)}")
    direct = {p: a for p, a in flat.items() if meta[p][0] == tuple(a.shape)}
    out = {}
    if direct:
        item = unflatten(direct)
        restored = ocp.PyTreeCheckpointer().restore(Path(directory).absolute() / PARAMS, args=ocp.args.PyTreeRestore(
            item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True))
        out.update(flatten(restored))
    for p, a in flat.items():
        if p in direct:
            continue
        stored = read_params(directory, [p])[p]
        if p not in VOCAB_AXES or np.delete(stored.shape, VOCAB_AXES[p]).tolist() != np.delete(
                a.shape, VOCAB_AXES[p]).tolist():
            raise ConversionError(f"parameter {p!r}: checkpoint has shape {stored.shape}, the model wants {a.shape}")
        value = fit_vocab(p, stored, a.shape[VOCAB_AXES[p]]).astype(a.dtype)
        out[p] = jax.device_put(value, a.sharding)
    return unflatten(out)


def write_json(path, data: dict):
    Path(path).write_text(json.dumps(data, indent=2) + "\n")
