"""One process of a two-process CPU run: `python tests/helpers/multiprocess_train.py PROCESS_ID PORT OUT_JSON`.

Each process has 4 CPU devices; the mesh (tp=2 x dp=4) spans both, and each process feeds only its half of
every global batch. Writes the logged losses to OUT_JSON.
"""

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["JAX_NUM_CPU_DEVICES"] = "4"

import jax  # noqa: E402


def main(process_id: int, port: int, out: str):
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id,
                               cluster_detection_method="deactivate")
    from tests.helpers.train_utils import multiprocess_config, pattern_batches  # noqa: PLC0415
    from mjax.train.loop import train  # noqa: PLC0415

    cfg = multiprocess_config()
    half = cfg.train.global_batch_size // 2

    def local_batches():
        for batch in pattern_batches(cfg):
            yield {k: v[process_id * half:(process_id + 1) * half] for k, v in batch.items()}

    result = train(cfg, data=(local_batches(), None))
    with open(out, "w") as f:
        json.dump([r["loss"] for r in result.history], f)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
