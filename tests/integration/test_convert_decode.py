"""KV-cache decoding reproduces the full forward pass; generation (greedy, sampled) and scripts/generate.py."""

import functools
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mjax.convert import load_pretrained
from mjax.inference.generate import generate
from mjax.inference.decode import forward_with_cache, init_cache
from tests.helpers.convert_utils import FIXTURES, reference

# Training runs and compiled steps: the full suite (make test-all) only, not make test.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def _load(name):
    """load_pretrained of a fixture, once per module: its tests share the compiled model(tokens) of the reference
    tokens' shape (a causal model's logits at position i are those of the prefix ending at i, so one forward of a
    generated sequence checks each greedy choice)."""
    return load_pretrained(FIXTURES / name)


# window + GQA; learned positions + biases; MLA with q LoRA, YaRN and MoE (V3) and without q LoRA (V2)
@pytest.fixture(scope="module", params=["mistral_swa", "gpt2", "deepseek_v3", "deepseek_v2"])
def loaded(request):
    model, cfg = _load(request.param)
    return model, cfg, jnp.asarray(reference(request.param)["tokens"])


def test_cached_decoding_equals_full_forward(loaded):
    model, cfg, tokens = loaded
    b, t = tokens.shape
    full = model(tokens)  # [B, T, V]
    cache = init_cache(cfg.model, b, t + 3)
    prompt = min(10, t - 2)  # a prefill longer than Mistral's window of 8, then one token per step
    positions = jnp.broadcast_to(jnp.arange(prompt), (b, prompt))
    step = jax.jit(forward_with_cache, static_argnums=0)
    logits, cache = step(model.model_def, model.params, tokens[:, :prompt], positions, cache)
    steps = [logits]
    for i in range(prompt, t):
        logits, cache = step(model.model_def, model.params, tokens[:, i:i + 1], jnp.full((b, 1), i), cache)
        steps.append(logits)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(steps, 1))[..., :cfg.model.vocab_size], np.asarray(full),
                               atol=2e-5, rtol=0)


def test_greedy_generation_matches_argmax_of_full_forward():
    model, cfg = _load("mistral_swa")
    tokens = jnp.asarray(reference("mistral_swa")["tokens"])
    new = np.asarray(generate(model.model_def, model.params, tokens[:, :6], 4))
    seq = np.asarray(tokens).copy()
    seq[:, 6:10] = new  # the prompt and the generated tokens, then tokens no logit below depends on
    np.testing.assert_array_equal(new, np.argmax(np.asarray(model(seq))[:, 5:9], -1))
    top1 = generate(model.model_def, model.params, tokens[:, :6], 4, temperature=0.7, top_k=1, seed=5)
    np.testing.assert_array_equal(np.asarray(top1), new)  # sampling among the top 1 is greedy


def test_mla_cache_holds_the_latent_not_per_head_keys():
    model, cfg = _load("deepseek_v3")
    m = cfg.model
    cache = init_cache(m, 2, 16)
    layers = {name: stack["latent"].shape[0] for name, stack in cache.items()}
    assert sum(layers.values()) == m.num_layers
    for stack in cache.values():
        assert set(stack) == {"latent", "k_rope"}
        assert stack["latent"].shape[1:] == (2, 16, m.kv_lora_rank)
        assert stack["k_rope"].shape[1:] == (2, 16, m.qk_pos_emb_head_dim)
    tokens = np.asarray(reference("deepseek_v3")["tokens"])
    new = np.asarray(generate(model.model_def, model.params, tokens[:1, :5], 3))
    seq = tokens.copy()
    seq[:1, 5:8] = new  # row 0: the prompt and the generated tokens (the rows are independent: dropless routing)
    np.testing.assert_array_equal(new, np.argmax(np.asarray(model(seq))[:1, 4:7], -1))


def test_generation_beyond_learned_positions_is_refused():
    model, cfg = _load("gpt2")
    with pytest.raises(ValueError, match="exceeds the 64 learned positions"):
        generate(model.model_def, model.params, np.zeros((1, 60), np.int32), 8)


def test_generate_script_runs_with_the_checkpoint_tokenizer():
    cmd = [sys.executable, str(ROOT / "scripts" / "generate.py"), f"--load={FIXTURES / 'llama3_gqa'}",
           "--prompt=the quick brown", "--max_new_tokens=5"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("ids: [") and lines[1].startswith("the quick brown")


def test_sampling_draws_from_the_top_k():
    from mjax.inference.generate import sample

    logits = jnp.asarray([[0.0, 5.0, 4.0, -1.0, 3.0]] * 64)  # [B, V]
    draws = np.asarray(sample(logits, jax.random.key(0), 1.0, 2))
    assert set(draws.tolist()) == {1, 2}
    assert set(np.asarray(sample(logits, jax.random.key(0), 0.0, 0)).tolist()) == {1}
