"""Generates text from a checkpoint: the quick check of a converted or trained model.

    mjax-generate --load=ckpt/llama --prompt="The capital of France is" --max_new_tokens=32
    mjax-generate --load=path/to/hf_model --prompt="Once upon" --temperature=0.8 --top_k=50 --seed=1

    mjax-generate --load=runs/tiny --prompt="Once upon a time"   # an `mjax-train --save` directory

(`mjax-generate` is also `python scripts/generate.py` or `python -m mjax.cli.generate`.)

--load takes an mjax checkpoint (mjax-convert output), a training checkpoint (the latest step unless
--ckpt_step) or a Hugging Face model directory (mjax/convert/source.py decides which). The tokenizer is the one the
checkpoint goes with, found as export finds it (mjax/convert/tokenizer.py): for a training run the one its saved
config names (the bundled sample tokenizer after a default run; tiktoken too), else <load>/tokenizer.json.
--tokenizer names another tokenizer.json; --prompt_ids=1,2,3 skips the tokenizer. Greedy when --temperature=0.
Decoding uses a KV cache (mjax/inference/decode.py); generation stops at the model's EOS token.

Errors are one line naming the flag or file. Exit codes (the table in mjax/cli/common.py):
    0  generated
    2  bad input: a bad flag value, a --load or --tokenizer that does not exist, no tokenizer to be found, an empty
       prompt, prompt ids outside the vocab, a prompt longer than the model's positions
    4  an unusable checkpoint: --load is not a checkpoint, or is unreadable
"""

import json
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

from absl import flags

from mjax.cli.common import BAD_INPUT, CHECKPOINT, fail, no_positional, run
from mjax.config import ConfigError
from mjax.logging_setup import setup_logging

flags.DEFINE_string("load", None, "mjax checkpoint (converted or a training --save directory) or Hugging Face model "
                    "directory.")
flags.DEFINE_integer("ckpt_step", None, "--load of a training checkpoint: the step (default: latest).")
flags.DEFINE_string("prompt", "", "Text to continue.")
flags.DEFINE_list("prompt_ids", None, "Token ids to continue instead of --prompt (no tokenizer needed).")
flags.DEFINE_string("tokenizer", None, "A tokenizer.json (default: the tokenizer --load goes with).")
flags.DEFINE_integer("max_new_tokens", 32, "Tokens to generate.", lower_bound=1)
flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 is greedy.", lower_bound=0.0)
flags.DEFINE_integer("top_k", 0, "Sample among the k most likely tokens; 0 means all.", lower_bound=0)
flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Params and compute dtype.")
flags.mark_flag_as_required("load")
FLAGS = flags.FLAGS


def eos_ids(directory: Path) -> set[int]:
    ids = set()
    for name in ("generation_config.json", "hf_config.json", "config.json"):
        path = directory / name
        if path.exists():
            value = json.loads(path.read_text()).get("eos_token_id")
            ids.update(value if isinstance(value, list) else [value] if isinstance(value, int) else [])
    return ids


def main(argv) -> int:
    setup_logging()
    from mjax.convert import ConversionError, InputError  # noqa: PLC0415
    from mjax.inference import PromptError  # noqa: PLC0415

    try:
        no_positional(argv)
        return _generate(Path(FLAGS.load))
    except ConversionError as e:
        if isinstance(e, InputError):
            return fail("generate", e, BAD_INPUT)
        return fail("generate: unusable checkpoint", e, CHECKPOINT)
    except (ConfigError, FileNotFoundError, PromptError) as e:
        return fail("generate", e, BAD_INPUT)


class PromptTokenizer(NamedTuple):
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    eos: set[int]


def _tokenizer(found) -> PromptTokenizer | None:
    """The prompt's tokenizer, or None when there is none to be found."""
    from tokenizers import Tokenizer  # noqa: PLC0415

    from mjax.convert import tokenizer as tokenizer_io  # noqa: PLC0415

    if FLAGS.tokenizer:
        if not Path(FLAGS.tokenizer).is_file():
            raise ConfigError(f"--tokenizer={FLAGS.tokenizer} does not exist")
        tok = Tokenizer.from_file(FLAGS.tokenizer)
        return PromptTokenizer(lambda text: tok.encode(text).ids, tok.decode, set())
    if found.kind == "training":  # the run's own tokenizer, encoding as its data was encoded
        tok = tokenizer_io.training_tokenizer(found, "--tokenizer or --prompt_ids")
        if tok is None:
            return None
        try:
            eos = {tok.eod_id}
        except ConfigError:  # none
            eos = set()
        return PromptTokenizer(tok.encode, tok.decode, eos)
    files = tokenizer_io.find(found)
    if files is None or files.tokenizer_json is None:
        return None
    tok = files.load()
    return PromptTokenizer(lambda text: tok.encode(text).ids, tok.decode, {files.eos_id()} - {None})


def _generate(load: Path) -> int:
    import numpy as np  # noqa: PLC0415

    from mjax.convert import load_pretrained, source  # noqa: PLC0415
    from mjax.inference.generate import generate  # noqa: PLC0415

    found = source.resolve(load, FLAGS.ckpt_step, flag="--load")
    tokenizer, stop = None, eos_ids(found.directory)
    if FLAGS.prompt_ids is None:
        tokenizer = _tokenizer(found)
        if tokenizer is None:
            raise ConfigError(f"no tokenizer goes with --load={load} ({found.kind} checkpoint); pass --tokenizer or "
                              "--prompt_ids")
        ids = tokenizer.encode(FLAGS.prompt)
        stop |= tokenizer.eos
    else:
        try:
            ids = [int(i) for i in FLAGS.prompt_ids]
        except ValueError:
            raise ConfigError(f"--prompt_ids={','.join(FLAGS.prompt_ids)}: not a list of integers") from None
    if not ids:
        raise ConfigError("the prompt is empty; pass --prompt or --prompt_ids")
    model, cfg = load_pretrained(found, dtype=FLAGS.dtype)
    bad = [i for i in ids if not 0 <= i < cfg.model.vocab_size]
    if bad:  # an embedding lookup would clamp them silently
        raise ConfigError(f"prompt token id(s) {bad[:5]} outside the model's vocab of {cfg.model.vocab_size}")
    t0 = time.perf_counter()
    out = generate(model.model_def, model.params, np.asarray([ids], np.int32), FLAGS.max_new_tokens,
                   temperature=FLAGS.temperature, top_k=FLAGS.top_k, seed=FLAGS.seed)
    new = [int(i) for i in np.asarray(out)[0]]
    for i, tok in enumerate(new):
        if tok in stop:
            new = new[:i]
            break
    elapsed = time.perf_counter() - t0
    print(f"ids: {new}")
    if tokenizer is not None:
        print(FLAGS.prompt + tokenizer.decode(new))
    print(f"{len(new)} tokens in {elapsed:.1f}s (including compilation)", file=sys.stderr)
    return 0


def entry() -> None:
    run(main)


if __name__ == "__main__":
    entry()
