import jax
import numpy as np
import pytest

from mjax.config import OptimizerConfig, load_config
from mjax.train.metrics import flops_per_step, peak_tflops
from mjax.train.optimizer import decay_mask, lr_schedule


def test_flops_llama3_8b_matches_megatron_published_per_token_figure():
    # Megatron-LM's current formula gives 51.47 GFLOP/token for Llama3-8B at seq 8192 (see docs/metrics.md).
    m = load_config("llama3-8b").model
    assert flops_per_step(m, 1, 8192) / 8192 / 1e9 == pytest.approx(51.47, abs=0.005)


def test_flops_gpt2_by_hand():
    # h=768, L=12, f=3072, GELU (2 GEMMs), MHA, padded vocab 50304, s=1024, one sequence:
    #   MLP       6*768*3072*2*12            = 339,738,624 per token
    #   attn lin  6*(768*(768+2*768)+768^2)*12 = 169,869,312 per token
    #   logits    6*768*50304                = 231,800,832 per token
    #   core      6*768*12 per (token pair)  = 55,296 x 1024^2
    expected = 1024 * (339_738_624 + 169_869_312 + 231_800_832) + 1024**2 * 55_296
    assert flops_per_step(load_config("gpt2").model, 1, 1024) == expected == 817_184_636_928


def test_peak_is_none_on_cpu_unless_given():
    assert peak_tflops(jax.devices()[0]) is None
    assert peak_tflops(jax.devices()[0], override=123.0) == 123.0


@pytest.mark.parametrize("style, step, expected", [
    ("constant", 5, 0.5), ("constant", 50, 1.0),
    ("linear", 10, 1.0), ("linear", 55, 0.55), ("linear", 100, 0.1), ("linear", 200, 0.1),
    ("cosine", 55, 0.55), ("cosine", 32.5, 0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * 0.25)))])
def test_lr_schedules(style, step, expected):
    cfg = OptimizerConfig(lr=1.0, min_lr=0.1, lr_warmup_iters=10, lr_decay_style=style)
    assert float(lr_schedule(cfg, 100)(step)) == pytest.approx(expected, rel=1e-5)


def test_wsd_holds_then_decays_over_the_last_iters():
    cfg = OptimizerConfig(lr=1.0, min_lr=0.0, lr_warmup_iters=10, lr_decay_style="wsd", lr_wsd_decay_iters=20,
                          lr_wsd_decay_style="linear")
    schedule = lr_schedule(cfg, 100)
    assert [float(schedule(s)) for s in (5, 50, 80, 90, 100)] == pytest.approx([0.5, 1.0, 1.0, 0.5, 0.0])


def test_weight_decay_skips_norms_and_biases():
    params = {"layers": {"attn_norm": {"scale": 0}, "attn": {"q_proj": {"kernel": 0, "bias": 0}}},
              "embed": {"embedding": 0}}
    mask = decay_mask(params)
    assert mask == {"layers": {"attn_norm": {"scale": False}, "attn": {"q_proj": {"kernel": True, "bias": False}}},
                    "embed": {"embedding": True}}
