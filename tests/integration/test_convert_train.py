"""A converted model continues training: its first-step loss equals the loss of the HF reference logits."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from mjax.convert import hf_to_mjax, load_pretrained, mjax_to_hf
from tests.helpers.convert_utils import FIXTURES, next_token_loss, reference

# Training runs and compiled steps: the full suite (make test-all) only, not make test.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _batches(tokens):
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": np.ones(tokens[:, 1:].shape, np.float32)}
    while True:
        yield {k: v.copy() for k, v in batch.items()}


# qwen2_moe: dense and MoE stacks, shared experts; llama3_gqa goes through scripts/train.py below
@pytest.mark.parametrize("name", ["gpt2", "qwen2_moe"])
def test_first_step_loss_equals_hf_loss(name, tmp_path):
    from mjax.train.loop import build, train
    from mjax.train.state import TrainState

    hf_to_mjax(FIXTURES / name, tmp_path / "ckpt")
    ref = reference(name)
    model, cfg = load_pretrained(tmp_path / "ckpt")
    b, t = ref["tokens"].shape
    cfg = cfg.replace(train=dict(train_iters=1, global_batch_size=b, seq_length=t - 1),
                      precision=dict(compute_dtype="float32", params_dtype="float32"),
                      logging=dict(log_interval=1, progress=False),
                      checkpoint=dict(save=str(tmp_path / "run"), async_save=False))
    devices = jax.devices()[:1]
    setup = build(cfg, devices)
    state = TrainState.create(model.params, setup.tx, jax.random.key(0), cfg.precision)
    state = jax.device_put(state, setup.state_sharding)
    result = train(cfg, data=(_batches(ref["tokens"]), None), devices=devices, state=state)
    assert result.history[0]["loss"] == pytest.approx(float(ref["loss"]), abs=2e-5)

    # ... and the trained model goes back out: export the training checkpoint, reload it as an HF directory. Its
    # saved config names the default sample tokenizer, which these batches never used.
    mjax_to_hf(tmp_path / "run", tmp_path / "trained_hf", with_tokenizer=False)
    trained, _ = load_pretrained(tmp_path / "trained_hf")
    want = np.asarray(setup.model.apply(result.state.params, ref["tokens"]))[..., :cfg.model.vocab_size]
    np.testing.assert_allclose(np.asarray(trained(ref["tokens"])), want, atol=1e-5)
    assert not np.allclose(want, ref["logits"], atol=1e-4)  # the step changed the weights


def test_train_script_load_params_only_first_step_loss(tmp_path):
    """Through scripts/train.py: --load_params_only on a converted checkpoint, data = one fixture row."""
    from mjax.data.indexed import IndexedDatasetWriter

    ckpt = tmp_path / "ckpt"
    hf_to_mjax(FIXTURES / "llama3_gqa", ckpt)
    ref = reference("llama3_gqa")
    row = ref["tokens"][:1]  # one document of seq_length + 1 tokens: every sample is exactly this row
    with IndexedDatasetWriter(tmp_path / "data" / "row", np.uint16) as w:
        w.add_document(row[0])
    metrics = tmp_path / "metrics.jsonl"
    cmd = [sys.executable, str(ROOT / "scripts" / "train.py"), f"--config={ckpt / 'config.json'}", f"--load={ckpt}",
           "--load_params_only", f"--data_path={tmp_path / 'data' / 'row'}", "--split=1,0,0",
           "--data.tokenizer_type=huggingface", f"--data.tokenizer_model={ckpt / 'tokenizer.json'}",
           "--train_iters=1", "--global_batch_size=1", f"--seq_length={row.shape[1] - 1}", "--eval_interval=0",
           "--nobf16", "--precision.compute_dtype=float32", "--log_interval=1", "--nologging.progress",
           f"--metrics_file={metrics}"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = json.loads(metrics.read_text().splitlines()[0])
    assert first["step"] == 1
    assert first["loss"] == pytest.approx(next_token_loss(ref["logits"][:1], row), abs=2e-5)


def test_load_pretrained_returns_config_and_unpadded_logits():
    model, cfg = load_pretrained(FIXTURES / "qwen2_tied", dtype="bfloat16", compute_dtype="float32")
    assert cfg.model.vocab_size == 300 and cfg.model.add_qkv_bias and not cfg.model.untie_embeddings_and_output_weights
    assert dataclasses.asdict(cfg.precision)["params_dtype"] == "bfloat16"
    assert model.params["embed"]["embedding"].dtype == jax.numpy.bfloat16
    ref = reference("qwen2_tied")
    np.testing.assert_allclose(np.asarray(model(ref["tokens"])), ref["logits"], atol=2e-5)  # weights were bf16


def test_mjax_exports_load_pretrained_lazily():
    code = ("import sys, mjax; assert 'jax' not in sys.modules and 'orbax' not in sys.modules; "
            "from mjax.convert.pretrained import load_pretrained; assert mjax.load_pretrained is load_pretrained")
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
