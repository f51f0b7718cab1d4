"""One process of the two-process checkpoint test: `python tests/helpers/multiprocess_checkpoint.py PROCESS_ID PORT DIR OUT`.

4 CPU devices per process; mock data read through mjax's loader (each process its half of every batch). Two runs:
  save:    tp=2 x dp=4, 4 steps, a checkpoint every 2 steps in DIR/a.
  resume:  fsdp=2 x tp=2 x dp=2, from step 2 of DIR/a, saving to DIR/b. Process 0 alone receives SIGTERM after
           step 4; both processes must stop at the same step with its checkpoint written.
Writes {"save": losses, "resume": losses, "stopped_at": step} to OUT.
"""

import json
import os
import signal
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["JAX_NUM_CPU_DEVICES"] = "4"

import jax  # noqa: E402


def main(process_id: int, port: int, directory: str, out: str):
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id,
                               cluster_detection_method="deactivate")
    from mjax.train.checkpoint import Checkpointer  # noqa: PLC0415
    from mjax.logging_setup import setup_logging  # noqa: PLC0415
    from mjax.train.loop import train  # noqa: PLC0415
    from tests.helpers.train_utils import multiprocess_config  # noqa: PLC0415

    setup_logging()
    cfg = multiprocess_config().replace(data=dict(mock_data=True))
    first, second = f"{directory}/a", f"{directory}/b"
    saved = train(cfg.replace(train=dict(train_iters=4), checkpoint=dict(save=first, save_interval=2)))

    after_step = Checkpointer.after_step

    def preempt_process_0(self, step, state, consumed):
        if step == 4 and process_id == 0:
            os.kill(os.getpid(), signal.SIGTERM)  # JAX's preemption notifier takes it (no Python handler)
        return after_step(self, step, state, consumed)

    Checkpointer.after_step = preempt_process_0
    resumed = train(cfg.replace(train=dict(train_iters=100), parallel=dict(fsdp=2),
                                checkpoint=dict(save=second, load=first, ckpt_step=2)))
    with open(out, "w") as f:
        json.dump({"save": [r["loss"] for r in saved.history], "resume": [r["loss"] for r in resumed.history],
                   "stopped_at": resumed.stopped_at}, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
