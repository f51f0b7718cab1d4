"""--deterministic_mode reaches every program a training run compiles: the init, the train step, the evaluation
and the fresh optimizer state of --load_params_only (on CPU the options are recorded, XLA:CPU ignores them;
tests/gpu/test_deterministic_mode.py checks that GPU steps repeat bitwise), and the attention kernel choice (which
then skips cuDNN's, failing under XLA's deterministic ops)."""

import sys

import jax
import pytest

from mjax.kernels.attention import dispatch
from mjax.train.loop import build
from mjax.train.loop import train as run
from mjax.xla_flags import DETERMINISTIC_OPTIONS
from tests.helpers.train_utils import pattern_batches, tiny_config


def test_every_compile_of_a_run_takes_the_deterministic_options(monkeypatch, tmp_path):
    real_jit, calls = jax.jit, []

    def recording_jit(fn, **kwargs):
        caller = sys._getframe(1).f_code.co_filename.replace("\\", "/")
        if "/mjax/train/" in caller:
            calls.append((caller.rsplit("/", 1)[-1], getattr(fn, "__name__", ""), kwargs.get("compiler_options")))
        return real_jit(fn, **kwargs)

    monkeypatch.setattr(jax, "jit", recording_jit)
    real_choose, chosen = dispatch.choose_impl, []

    def recording_choose(impl, **facts):
        chosen.append(facts["deterministic"])
        return real_choose(impl, **facts)

    monkeypatch.setattr(dispatch, "choose_impl", recording_choose)
    ckpt = str(tmp_path / "ckpt")
    cfg = tiny_config(execution=dict(deterministic_mode=True), train=dict(train_iters=1, eval_interval=1, eval_iters=1),
                      checkpoint=dict(save=ckpt, save_interval=1, async_save=False))
    valid = next(pattern_batches(cfg, seed=1))
    run(cfg, data=(pattern_batches(cfg), lambda: iter([valid])))
    tuned = cfg.replace(checkpoint=dict(save=None, save_interval=0, load=ckpt, load_params_only=True),
                        train=dict(eval_interval=0))
    run(tuned, data=(pattern_batches(tuned), None))
    assert {name for _, name, _ in calls} == {"create", "step", "eval_step", "state_from_params"}, calls
    assert [c for c in calls if c[2] != DETERMINISTIC_OPTIONS] == [], calls
    assert chosen and all(chosen), chosen  # every attention call of the model was chosen as deterministic
    # an option of one compile that would undo the run's is refused, not merged over it
    with pytest.raises(ValueError, match="deterministic_mode"):
        build(cfg).init_state(0, {"xla_gpu_deterministic_ops": False})
    # without the flag no options are added, and deterministic ops asked for by one compile are refused: the
    # model's kernel choices were made without knowing them
    calls.clear()
    plain = build(tiny_config())
    plain.jit(lambda x: x)
    assert calls == [("loop.py", "<lambda>", None)]
    with pytest.raises(ValueError, match="set --deterministic_mode instead"):
        plain.init_state(0, {"xla_gpu_exclude_nondeterministic_ops": True})
    chosen.clear()
    plain_cfg = tiny_config(train=dict(train_iters=1))
    run(plain_cfg, data=(pattern_batches(plain_cfg), None))
    assert chosen and not any(chosen), chosen
