"""The step profile sums real device (here: CPU thunk) time per kernel, kind and model part."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.harness import synthetic_batch
from mjax.train.loop import build
from benchmarks.profile import kernel_kind, op_scopes, profile_step
from tests.helpers.train_utils import tiny_config

# Training runs and compiled steps: the full suite (make test-all) only, not make test.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def compiled_step():
    cfg = tiny_config()
    setup = build(cfg, jax.devices()[:1])
    # Weights drawn by NumPy, not setup.init_state: the profile only times the step, and compiling the jit'ed random
    # init takes XLA:CPU about as long as compiling the step itself.
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: jnp.asarray(rng.normal(0, 0.02, s.shape), s.dtype), setup.model.abstract_params())
    state = setup.state_from_params(params, jax.random.key(0))
    batch = synthetic_batch(cfg, setup)
    compiled, _ = setup.compile_step(state, batch)
    return setup, compiled, state, batch


def test_profile_labels_model_parts_and_accounts_for_the_step(compiled_step):
    _, compiled, state, batch = compiled_step
    box = [state]

    def run():
        box[0], metrics = compiled(box[0], batch)
        jax.block_until_ready(metrics)

    run()
    prof = profile_step(run, 2, compiled.as_text(), top=5)
    assert 0 < prof.busy_ms_per_step <= prof.wall_ms_per_step
    # Every part of the model is found through the named scopes of the compiled ops.
    for part in ("attention", "mlp", "norm", "loss", "embedding"):
        assert prof.by_scope.get(part, 0) > 0, prof.by_scope
    assert prof.by_kind.get("matmul", 0) > 0
    assert len(prof.top_kernels) == 5 and prof.top_kernels[0][3] >= prof.top_kernels[-1][3]
    assert prof.matched > 0.9, prof.unmatched_examples
    assert "device busy" in prof.format()


def test_hlo_text_gives_opcode_and_scope(compiled_step):
    _, compiled, _, _ = compiled_step
    scopes = op_scopes(compiled.as_text())
    dots = [(op, name) for op, name in scopes.values() if op == "dot"]
    assert dots and any("mlp" in name for _, name in dots) and any("attention" in name for _, name in dots)


def test_kernel_names_map_to_kinds():
    assert kernel_kind("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT") == "matmul"
    assert kernel_kind("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == "attention"
    assert kernel_kind("ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == "collective"
    assert kernel_kind("loop_multiply_fusion_3") == "fusion/other"
    assert kernel_kind("custom-call.3", "custom-call") == "fusion/other"
    assert kernel_kind("ynn_fusion.12", "fusion", "dot_general") == "matmul"  # XLA:CPU's library fusion of a dot
    assert kernel_kind("loop_multiply_fusion", "fusion", "mul") == "fusion/other"


def test_xla_options_reach_the_compiler(compiled_step):
    setup, _, state, batch = compiled_step
    with pytest.raises(Exception, match="no_such_xla_option"):
        setup.compile_step(state, batch, {"no_such_xla_option": True})


def test_exposed_time_counts_only_what_compute_does_not_cover():
    from benchmarks.profile import _exposed_ns

    compute = [(0, 10), (5, 20), (30, 40)]
    assert _exposed_ns([(15, 35)], compute) == 10  # 20..30 uncovered
    assert _exposed_ns([(0, 5), (50, 60)], compute) == 10
    assert _exposed_ns([], compute) == 0


def test_command_buffer_kernels_are_found_by_their_fusion_name():
    from benchmarks.profile import _hlo_name

    scopes = {"loop_add_fusion.3": ("fusion", "jit(step)/mlp/add"), "custom-call.2": ("custom-call", "")}
    assert _hlo_name("loop_add_fusion_3", "command_buffer_1", scopes) == "loop_add_fusion.3"
    assert _hlo_name("nvjet_sm90_tst", "custom-call.2", scopes) == "custom-call.2"
    assert _hlo_name("nvjet_sm90_tst", "command_buffer_1", scopes) is None
