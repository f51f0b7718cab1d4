"""The planner's memory model against XLA's own estimate of the compiled train step, over layouts of every kind
(dense and MoE, every pipeline schedule, each recomputation policy, context and expert parallelism), on 8 CPU
devices. The model is small, but its sequence and hidden sizes make activations and states, not fixed overheads,
most of each device's memory."""

import dataclasses
import time

import jax
import pytest

from mjax.parallel.layout import validate_layout
from mjax.plan.compiled import compiled_bytes
from mjax.plan.memory import memory
from tests.helpers.train_utils import FAST_COMPILE, tiny_config

DENSE = dict(num_layers=4, hidden_size=256, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=1024,
             vocab_size=1024)
MOE = dict(DENSE, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=512)
TOLERANCE = 0.10  # the planner's target (docs/planner.md)

# (model, parallel, remat policy, micro-batch size)
LAYOUTS = [
    (DENSE, dict(), "none", 2),
    (DENSE, dict(), "selective", 2),
    (DENSE, dict(), "full", 2),
    (DENSE, dict(tp=2, sequence_parallel=True), "none", 2),
    (DENSE, dict(tp=4), "selective", 4),
    (DENSE, dict(fsdp=8, dp=1), "none", 2),
    (DENSE, dict(use_distributed_optimizer=True), "selective", 1),
    (DENSE, dict(pp=2), "none", 1),
    (DENSE, dict(pp=2, pipeline_schedule="gpipe"), "selective", 1),
    (DENSE, dict(pp=2, vpp=2, pipeline_schedule="interleaved_1f1b"), "full", 1),
    (DENSE, dict(pp=2, vpp=2, pipeline_schedule="interleaved"), "none", 1),
    (DENSE, dict(pp=4, tp=2), "full", 2),
    (DENSE, dict(cp=2, cp_comm_type="p2p"), "none", 2),
    (DENSE, dict(cp=2, cp_comm_type="all_gather"), "selective", 2),
    (DENSE, dict(cp=2, cp_comm_type="a2a"), "none", 2),
    (DENSE, dict(cp=4, tp=2), "full", 4),
    (MOE, dict(ep=8), "none", 2),
    (MOE, dict(ep=4), "selective", 2),
    (MOE, dict(ep=2, tp=2, sequence_parallel=True), "none", 2),
    (MOE, dict(ep=4, tp=2, expert_tensor_parallel_size=1), "full", 2),
    (MOE, dict(pp=2, ep=4), "none", 1),
    (MOE, dict(ep=2, cp=2), "selective", 2),
    (DENSE, dict(pp=2, pipeline_schedule="zero_bubble"), "selective", 1),
]


# The layouts the test compiles (indexes into LAYOUTS, the table of docs/planner.md): every feature above, each
# schedule and comm type, and each layout that exercises a term of its own. Left out, as each of their features is
# in a kept layout: 0 and 1 (plain dp, none / selective at M = 1: 2 full M = 1, 5 and 16 none M = 1, 3 and 18 none,
# 4, 6 and 21 selective), 7 (pp=2 1f1b, its inlined cool-down: 20 and 22 are pp=2 1F1B-family, 11 dense 1f1b), 12
# (p2p: 15 dense, 21 MoE) and 17 (MoE ep=4, selective, M = 1: 19 and 20 ep=4, 21 selective, 16 M = 1; the experts'
# dense expansion in a recomputed layer: 19 and 21).
CHECKED = (2, 3, 4, 5, 6, 8, 9, 10, 11, 13, 14, 15, 16, 18, 19, 20, 21, 22)

# Layouts (indexes into LAYOUTS) the model misses by more than TOLERANCE, with the error measured when they were
# listed (docs/planner.md, "Accuracy"): none today. The test fails when one of them comes within TOLERANCE (move it
# out of this set) or when any other layout leaves it.
KNOWN_MISSES: dict[int, float] = {}


def layout_config(model, parallel, remat, micro):
    return tiny_config(model=model, parallel=parallel, execution=dict(remat_policy=remat),
                       train=dict(seq_length=256, global_batch_size=16, micro_batch_size=micro))


def accuracy_rows(layouts=LAYOUTS):
    rows = []
    for model, parallel, remat, micro in layouts:
        cfg = layout_config(model, parallel, remat, micro)
        predicted = memory(cfg, validate_layout(cfg, 8), 8)
        t = time.perf_counter()
        got = compiled_bytes(cfg, jax.devices(), FAST_COMPILE)
        rows.append((("moe " if model is MOE else "dense ") + str(parallel) + f" {remat} mbs{micro}",
                     predicted, got, time.perf_counter() - t))
    return rows


def format_rows(rows, indexes=None) -> str:
    lines = []
    for i, (name, predicted, got, seconds) in zip(indexes or range(len(rows)), rows):
        error = predicted.total / got["total"] - 1
        mib = {k: v / 2**20 for k, v in dataclasses.asdict(predicted).items()}
        lines.append(f"{i:>2} {name:<70} predicted {predicted.total / 2**20:8.1f} MiB (act {mib['activations']:6.1f}, "
                     f"partial grads {mib['partial_grads']:5.1f}, transient {mib['transient']:5.1f}) "
                     f"XLA {got['total'] / 2**20:8.1f} MiB (temp {got['temporaries'] / 2**20:6.1f}) {error:+6.1%} "
                     f"[{seconds:.1f}s]")
    return "\n".join(lines)


@pytest.mark.slow
def test_predicted_memory_is_within_ten_percent_of_xla():
    """One compile per checked layout (about 2 minutes on 2 cores); every miss is reported at once."""
    rows = accuracy_rows([LAYOUTS[i] for i in CHECKED])
    misses = {i for i, r in zip(CHECKED, rows) if abs(r[1].total / r[2]["total"] - 1) > TOLERANCE}
    assert misses == set(KNOWN_MISSES), (
        f"layouts off by more than {TOLERANCE:.0%}: {sorted(misses)}, listed as known misses: "
        f"{sorted(KNOWN_MISSES)}\n" + format_rows(rows, CHECKED))


if __name__ == "__main__":  # the accuracy table (docs/planner.md): python -m tests.integration.test_plan_memory [i,j]
    import sys

    picked = [int(i) for i in sys.argv[1].split(",")] if len(sys.argv) > 1 else range(len(LAYOUTS))
    print(format_rows(accuracy_rows([LAYOUTS[i] for i in picked]), list(picked)))
