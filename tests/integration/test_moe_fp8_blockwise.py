"""MoE models with blockwise FP8 (--fp8_recipe=blockwise: the expert GEMMs in 1x128 / 128x128 blocks, DeepSeek-V3's
recipe; mjax/kernels/grouped_matmul/fp8_blockwise.py): config rules, the amaxes the experts report, and the Pallas
kernels (interpreted) against the reference in a train step.

Convergence (test_moe_fp8.py::test_fp8_moe_trains_within_fp8_tolerance_of_bf16[blockwise], against the bf16 run that
file trains once for every recipe): test_moe_fp8.py's model (1 dense + 2 MoE layers, 4 experts top-2 with a shared
expert, hidden 128) trained 50 steps by the training loop on the learnable pattern data, bf16 against blockwise,
from the same params and data. Measured over four seeds (1234 and 1-3): the mean losses of windows of 10 steps moved
by up to 0.136 from bf16's, the last window by up to 0.067, the first loss by up to 0.0006 (per-tensor FP8 on this
model: 0.124, 0.050, 0.0024). The tolerances are test_moe_fp8.py's, 1.5x over these."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mjax.config import ConfigError
from mjax.parallel.layout import validate_layout
from mjax.train.loop import build
from tests.helpers.train_utils import run_steps
from tests.integration.test_moe_fp8 import PROJECTIONS, _cfg, assert_expert_amaxes

BLOCKWISE = dict(fp8_recipe="blockwise")


def test_blockwise_fp8_with_moe_validates():
    validate_layout(_cfg(**BLOCKWISE), 1)
    # the shared experts are linear layers, which pad a partial last block (mjax/kernels/quant/policy.py)
    validate_layout(_cfg(**BLOCKWISE).replace(model=dict(moe_shared_expert_intermediate_size=64)), 1)


@pytest.mark.parametrize("model,flag", [(dict(moe_ffn_hidden_size=192), "--moe_ffn_hidden_size"),
                                        (dict(moe_ffn_hidden_size=None, ffn_hidden_size=320), "--ffn_hidden_size")])
def test_expert_sizes_not_multiples_of_128_are_one_config_error_naming_the_flag(model, flag):
    with pytest.raises(ConfigError, match="--fp8_recipe=blockwise needs GEMM sizes that are multiples of 128") as err:
        validate_layout(_cfg(**BLOCKWISE).replace(model=model), 1)
    assert flag in str(err.value)


@pytest.mark.slow  # a train step or a plan compiled: over 7 s on 2 cores
def test_experts_report_their_amaxes_and_bf16_layers_nothing():
    """Blockwise reads no scale from experts/*/fp8_meta [layers, experts, 3] but reports the amaxes through its
    "gradient" as per-tensor FP8 does: max |w[e]| per expert exactly, one max |x| and one max |grad| for every expert
    (gate and up share x), zeros in the layers kept in bf16."""
    cfg = _cfg(first_last_layers_bf16=True, **BLOCKWISE).replace(model=dict(num_layers=3, moe_first_dense_layers=0))
    setup = build(cfg, jax.devices()[:1])
    model = setup.model
    params, scales = model.init(jax.random.key(0)), model.init_fp8()
    tokens = jnp.arange(128, dtype=jnp.int32).reshape(4, 32) % 100  # 128 tokens: the dense layers' blockwise rows
    with setup.sharding():
        amax = jax.jit(jax.grad(lambda s: jnp.sum(model.apply(params, tokens, fp8=s)[..., :8])))(scales)
    for proj in PROJECTIONS:
        assert amax["moe_layers"]["mlp"]["experts"][proj]["fp8_meta"].shape == (3, 4, 3)
    assert_expert_amaxes(amax, params)


def _losses(cfg, devices=None):
    history, state = run_steps(cfg, devices or jax.devices()[:1])
    return np.array([float(r["loss"]) for r in history]), state


@pytest.mark.slow
def test_pallas_kernels_train_like_the_reference():
    """--moe_grouped_gemm_impl=pallas (the blockwise kernels interpreted; the dense layers' blockwise GEMMs too, with
    --quant_impl=pallas) against the dequantize + ragged_dot reference: the same quantized values, the GEMMs summed in
    another order (float32 noise, then bf16 roundings and FP8 rounding of the updated weights carry it on; measured
    7e-6 relative on the first loss, 2e-4 on the next two)."""
    cfg = _cfg(**BLOCKWISE).replace(model=dict(num_layers=2, moe_first_dense_layers=0),
                                   train=dict(train_iters=3, micro_batch_size=4))
    want, _ = _losses(cfg.replace(execution=dict(moe_grouped_gemm_impl="xla")))
    got, _ = _losses(cfg.replace(execution=dict(moe_grouped_gemm_impl="pallas"), precision=dict(quant_impl="pallas")))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4)
    np.testing.assert_allclose(got, want, rtol=2e-3)
