"""Shared helpers of the conversion tests: the HF fixtures (made by tools/make_hf_fixtures.py) and a loss."""

from pathlib import Path

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, which the library's numpy reader needs)
import numpy as np

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
NAMES = ("llama3_gqa", "llama_tied_mha", "mistral_swa", "qwen2_tied", "gpt2")
MOE_NAMES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")  # fixtures with HF's routing in reference.npz
LOGITS_ATOL = 2e-5  # fp32 against HF fp32; observed ~1.5e-6


def reference(name: str) -> dict:
    return dict(np.load(FIXTURES / name / "reference.npz"))


def next_token_loss(logits: np.ndarray, tokens: np.ndarray) -> float:
    """HF's causal-LM loss: mean cross-entropy of logits[:, :-1] against tokens[:, 1:]."""
    x = logits[:, :-1].astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
    return float(-np.take_along_axis(logp, tokens[:, 1:, None].astype(np.int64), -1).mean())


def read_safetensors(directory) -> dict:
    from safetensors.numpy import load_file  # an independent reader of what we wrote

    out = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def convert_both_ways(names, root: Path) -> dict:
    """name -> (mjax checkpoint dir, HF dir exported back with small shards) of each fixture, converted under root."""
    from mjax.convert import hf_to_mjax, mjax_to_hf  # noqa: PLC0415

    out = {}
    for name in names:
        hf_to_mjax(FIXTURES / name, root / name / "mjax")
        mjax_to_hf(root / name / "mjax", root / name / "hf", max_shard_bytes=100_000)
        out[name] = (root / name / "mjax", root / name / "hf")
    return out


def assert_same_tensors(original_dir: Path, exported_dir: Path) -> None:
    """Every tensor of original_dir's safetensors is in exported_dir's, with the same dtype, shape and bytes."""
    original, exported = read_safetensors(original_dir), read_safetensors(exported_dir)
    assert sorted(original) == sorted(exported)
    for k, a in original.items():
        b = exported[k]
        assert (a.dtype, a.shape) == (b.dtype, b.shape), k
        assert a.tobytes() == b.tobytes(), f"{k} differs after hf -> mjax -> hf"
