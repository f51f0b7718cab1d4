"""A `scripts/train.py --save` directory is a source like any other: `load_pretrained` and scripts/generate.py take
it (latest step, or a step), through the same resolution as export (mjax.convert.source)."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mjax.convert import InputError, load_pretrained, mjax_to_hf
from mjax.convert import source as sources
from mjax.data.tokenizer import build_tokenizer
from mjax.model import build_model

# Training runs and compiled steps: the full suite (make test-all) only, not make test.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent.parent
ENV = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1", PYTHONPATH=str(ROOT))
TOKENS = np.random.default_rng(0).integers(1, 1024, (2, 12)).astype(np.int32)  # [B, T]


def _reference_logits(cfg, params, tokens):
    """The trained params through the model built from the training config (not through any loader)."""
    model = build_model(cfg.model, cfg.precision)
    return np.asarray(model.apply(params, tokens))[..., :cfg.model.vocab_size]


def test_sources_are_resolved_once_for_every_reader(trained_run):
    save, _, _ = trained_run
    latest, first = sources.resolve(save), sources.resolve(save, 1)
    assert (latest.kind, latest.step, latest.directory) == ("training", 2, save / "2")
    assert (first.step, sources.resolve(save / "1").step) == (1, 1)  # a step directory itself
    with pytest.raises(InputError, match=r"--ckpt_step=7: .* holds steps \[1, 2\]"):
        sources.resolve(save, 7)


def test_load_pretrained_of_a_training_checkpoint(trained_run, tmp_path):
    save, cfg, params = trained_run
    want = _reference_logits(cfg, params, TOKENS)
    model, loaded_cfg = load_pretrained(save)  # the latest step (2): the trained params
    assert loaded_cfg.model == cfg.model
    assert loaded_cfg.execution == model.model_def.execution == cfg.execution  # the run's kernel choices
    chosen = dataclasses.replace(cfg.execution, attention_impl="xla")
    assert load_pretrained(save, execution=chosen)[0].model_def.execution == chosen
    # Same params; jitted against op by op, float32 logits of magnitude ~1 may differ in the last bits (measured 0).
    np.testing.assert_allclose(np.asarray(model(TOKENS)), want, atol=1e-5, rtol=0)
    step1, _ = load_pretrained(save, step=1)
    assert not np.allclose(np.asarray(step1(TOKENS)), want, atol=1e-4)  # step 1's weights: one update fewer
    mjax_to_hf(save, tmp_path / "hf", with_tokenizer=False)  # and the HF export of it loads to the same logits
    exported, _ = load_pretrained(tmp_path / "hf")
    np.testing.assert_allclose(np.asarray(exported(TOKENS)), want, atol=1e-5, rtol=0)


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by the full forward pass, one token at a time (no KV cache)."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(np.argmax(np.asarray(model(np.asarray([seq], np.int32)))[0, -1])))
    return seq[len(prompt):]


def test_generate_script_after_a_default_run_needs_no_tokenizer_flag(trained_run):
    save, cfg, _ = trained_run
    text = "The history of the"
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "generate.py"), f"--load={save}",
                          f"--prompt={text}", "--max_new_tokens=6"], env=ENV, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    tok = build_tokenizer(cfg.data)  # the run's tokenizer: the bundled sample one
    model, _ = load_pretrained(save)
    want = _greedy(model, tok.encode(text), 6)
    if tok.eod_id in want:  # generation stops at the run's end-of-document token
        want = want[:want.index(tok.eod_id)]
    lines = out.stdout.splitlines()
    assert lines[0] == f"ids: {want}"
    assert lines[1] == text + tok.decode(want)


def test_generate_script_with_a_step_that_is_not_there(trained_run):
    save, _, _ = trained_run
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "generate.py"), f"--load={save}", "--ckpt_step=7",
                          "--prompt_ids=1"], env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"--ckpt_step=7: {save} holds steps [1, 2]" in out.stderr
