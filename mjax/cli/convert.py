"""Converts checkpoints between Hugging Face and mjax (Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5, GPT-2, and the mixtures
of experts Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-MoE; docs/convert.md).

    mjax-convert --direction=hf_to_mjax --input=path/to/hf_model --output=ckpt/llama
    mjax-train --config=ckpt/llama/config.json --load=ckpt/llama --load_params_only ...
    mjax-convert --direction=mjax_to_hf --input=ckpt/llama --output=path/to/hf_out

(`mjax-convert` is also `python scripts/convert_checkpoint.py` or `python -m mjax.cli.convert`.)

hf_to_mjax reads config.json and model.safetensors (or shards with model.safetensors.index.json) and writes
config.json, params/ (an Orbax PyTree checkpoint of the params) and the tokenizer files; mjax_to_hf writes
config.json, safetensors shards (+ index) and the tokenizer, which `transformers` loads; its --input may also be a
training checkpoint (`mjax-train --save` directory, latest step unless --ckpt_step), whose tokenizer is the
one its saved config names (tokenizer.json + tokenizer_config.json; a tiktoken run needs --skip_tokenizer).
Tensors stream one (stacked) parameter at a time, so host memory stays near the largest parameter, not the model.

Errors are one line naming the flag or file. Exit codes (the table in mjax/cli/common.py):
    0  converted
    2  bad input: a bad flag value, an --input that does not exist, an --output that already holds a model, a
       tokenizer that cannot be written (a tiktoken run without --skip_tokenizer, a --tokenizer_model now gone)
    4  an unusable checkpoint: --input is not a checkpoint, is unreadable, or holds a model the conversion rejects
       (an unsupported architecture or config, a missing tensor, a shape that does not match config.json)
"""

import os
import resource
import sys
import time

from absl import flags

from mjax.cli.common import BAD_INPUT, CHECKPOINT, fail, no_positional, run
from mjax.config import ConfigError
from mjax.logging_setup import setup_logging

flags.DEFINE_enum("direction", None, ["hf_to_mjax", "mjax_to_hf"], "Which way to convert.")
flags.DEFINE_string("input", None, "Source directory (HF model directory or mjax checkpoint).")
flags.DEFINE_string("output", None, "Destination directory (created).")
flags.DEFINE_enum("dtype", "source", ["source", "float32", "bfloat16", "float16"],
                  "Dtype of the written tensors; `source` keeps each tensor's stored dtype.")
flags.DEFINE_string("architecture", None, "mjax_to_hf: the HF architecture to write, LlamaForCausalLM, "
                    "MistralForCausalLM, Qwen2ForCausalLM, GPT2LMHeadModel, MixtralForCausalLM, Qwen2MoeForCausalLM, "
                    "Qwen3MoeForCausalLM, OlmoeForCausalLM or DeepseekForCausalLM (default: the source HF config's, "
                    "else inferred).")
flags.DEFINE_integer("ckpt_step", None, "mjax_to_hf from a training checkpoint: the step (default: latest).")
flags.DEFINE_boolean("skip_tokenizer", False, "mjax_to_hf: write no tokenizer files (needed after "
                     "--tokenizer_type=tiktoken).")
flags.DEFINE_integer("max_shard_size_mb", 5000, "mjax_to_hf: largest safetensors shard, in MB.", lower_bound=1)
flags.mark_flags_as_required(["direction", "input", "output"])
FLAGS = flags.FLAGS


def peak_rss_bytes() -> int:
    """This process's peak resident memory. Linux: VmHWM, since ru_maxrss carries a parent's peak over exec (a
    benchmark that made a large checkpoint would be measured instead of the conversion)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def main(argv) -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # conversion is host work; keep accelerators free
    setup_logging()
    from mjax.convert import ConversionError, InputError, hf_to_mjax, mjax_to_hf  # noqa: PLC0415

    dtype = None if FLAGS.dtype == "source" else FLAGS.dtype
    t0 = time.perf_counter()
    try:
        no_positional(argv)
        if FLAGS.direction == "hf_to_mjax":
            summary = hf_to_mjax(FLAGS.input, FLAGS.output, dtype=dtype)
        else:
            summary = mjax_to_hf(FLAGS.input, FLAGS.output, dtype=dtype, architecture=FLAGS.architecture,
                                 max_shard_bytes=FLAGS.max_shard_size_mb * 10**6, step=FLAGS.ckpt_step,
                                 with_tokenizer=not FLAGS.skip_tokenizer)
    except (InputError, ConfigError, FileNotFoundError) as e:
        return fail("convert_checkpoint", e, BAD_INPUT)
    except ConversionError as e:
        return fail("convert_checkpoint: unusable checkpoint", e, CHECKPOINT)
    gb = summary["bytes"] / 1e9
    print(f"converted {FLAGS.input} -> {FLAGS.output} ({FLAGS.direction}): {gb:.3f} GB of tensors in "
          f"{time.perf_counter() - t0:.1f}s, peak RSS {peak_rss_bytes() / 1e9:.2f} GB")
    return 0


def entry() -> None:
    run(main)


if __name__ == "__main__":
    entry()
