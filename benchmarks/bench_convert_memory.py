"""Peak host memory and time of checkpoint conversion on a 7B-class model (no torch needed).

    python -m benchmarks.bench_convert_memory                      # Llama-3-8B shapes, bf16: ~16 GB per copy on disk
    python -m benchmarks.bench_convert_memory --num_layers=4       # the same tensors, fewer layers (quick)
    python -m benchmarks.bench_convert_memory --max_shard_size_mb=1000   # export in smaller shards

Writes random bf16 safetensors shards with the Hugging Face config of Meta-Llama-3-8B (one shard in memory at a
time), then runs `mjax-convert` (`python -m mjax.cli.convert`) hf_to_mjax and mjax_to_hf, each in a fresh process,
and prints a table of time and peak RSS against the model size. Export writes each tensor into its pre-planned byte
range, so its peak does not depend on --max_shard_size_mb (the input is written in 5 GiB shards). Disk: the HF input
is deleted before the export, so at most two copies (~32 GB for 8B) exist at once; `--workdir` is removed at the end
unless --keep.
"""

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
from absl import flags

from benchmarks.cli import run_main

from mjax.convert.safetensors_io import SafetensorsWriter

flags.DEFINE_string("workdir", "/tmp/mjax_bench_convert", "Scratch directory (deleted at the end unless --keep).")
flags.DEFINE_integer("num_layers", 32, "Layers of the Llama-3-8B config to generate (32 = the real model).")
flags.DEFINE_boolean("keep", False, "Keep the generated and converted checkpoints.")
flags.DEFINE_integer("max_shard_size_mb", 5000, "Export: largest safetensors shard, in MB (mjax-convert's).")
FLAGS = flags.FLAGS

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32, "vocab_size": 128256,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu",
    "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
}


def llama_tensors(c: dict) -> list[tuple[str, tuple]]:
    d, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    hd = d // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * hd
    out = [("model.embed_tokens.weight", (v, d))]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (d,)), (p + "self_attn.q_proj.weight", (d, d)),
                (p + "self_attn.k_proj.weight", (kv, d)), (p + "self_attn.v_proj.weight", (kv, d)),
                (p + "self_attn.o_proj.weight", (d, d)), (p + "post_attention_layernorm.weight", (d,)),
                (p + "mlp.gate_proj.weight", (f, d)), (p + "mlp.up_proj.weight", (f, d)),
                (p + "mlp.down_proj.weight", (d, f))]
    return out + [("model.norm.weight", (d,)), ("lm_head.weight", (v, d))]


def random_bf16(shape, rng) -> np.ndarray:
    """Random bf16 values of magnitude ~0.01 with random sign and mantissa (incompressible, cheap to make)."""
    bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    bits &= 0x807F
    bits |= 0x3C00
    return bits.view(ml_dtypes.bfloat16)


def make_checkpoint(directory: Path, config: dict) -> int:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    tensors = llama_tensors(config)
    writer = SafetensorsWriter(directory, [(n, s, np.dtype(ml_dtypes.bfloat16)) for n, s in tensors], 5 << 30)
    rng = np.random.default_rng(0)
    for name, shape in tensors:
        x = np.ones(shape, ml_dtypes.bfloat16) if len(shape) == 1 else random_bf16(shape, rng)
        writer.write(name, x)
        del x
    writer.close()
    return writer.total


def convert(direction: str, src: Path, dst: Path, *extra: str) -> tuple[float, float]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "mjax.cli.convert", f"--direction={direction}", f"--input={src}",
                           f"--output={dst}", *extra], capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{direction} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}")
    rss = float(re.search(r"peak RSS ([\d.]+) GB", proc.stdout).group(1))
    return elapsed, rss


def main():
    work = Path(FLAGS.workdir)
    shutil.rmtree(work, ignore_errors=True)
    config = dict(LLAMA3_8B, num_hidden_layers=FLAGS.num_layers)
    t0 = time.perf_counter()
    size = make_checkpoint(work / "hf", config)
    print(f"generated Llama-3-8B-shaped checkpoint ({FLAGS.num_layers} layers): {size / 1e9:.2f} GB bf16 in "
          f"{time.perf_counter() - t0:.0f}s", flush=True)
    rows = []
    try:
        rows.append(("hf_to_mjax", *convert("hf_to_mjax", work / "hf", work / "mjax")))
        shutil.rmtree(work / "hf")
        rows.append(("mjax_to_hf", *convert("mjax_to_hf", work / "mjax", work / "hf_out",
                                            f"--max_shard_size_mb={FLAGS.max_shard_size_mb}")))
    finally:
        if not FLAGS.keep:
            shutil.rmtree(work, ignore_errors=True)
    print("\n| direction  | model size | time (s) | peak RSS | peak RSS / model size |")
    print("|------------|-----------:|---------:|---------:|----------------------:|")
    for name, seconds, rss in rows:
        print(f"| {name} | {size / 1e9:.2f} GB | {seconds:.0f} | {rss:.2f} GB | {rss * 1e9 / size:.2f} |")


if __name__ == "__main__":
    run_main(main)
