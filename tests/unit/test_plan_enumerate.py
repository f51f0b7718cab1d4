"""The planner proposes only layouts train.py accepts, reports what does not fit with its reason, and counts the
train state's bytes as a hand count of the parameters does."""

import math

import jax
import pytest

from mjax.config import ConfigError, load_config
from mjax.model import build_model
from mjax.parallel.layout import validate_layout
from mjax.parallel.mesh import mesh_shape
from mjax.plan.enumerate import SearchSpace, candidates
from mjax.plan.machine import machine_from
from mjax.plan.rank import GIB, UNMODELLED_STAGES, make_plan, train_flags
from mjax.plan.states import state_bytes
from tests.helpers.train_utils import tiny_config

DENSE = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
             vocab_size=256)
MOE = dict(DENSE, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64)
SMALL = SearchSpace(remat_policies=("none", "full"), vpp_sizes=(2,))


def _cfg(model, **train):
    return tiny_config(model=model, train=dict(seq_length=64, global_batch_size=16, **train))


@pytest.mark.parametrize("model", [DENSE, MOE], ids=["dense", "moe"])
def test_every_proposed_layout_passes_validation_and_fits_the_machine(model):
    machine = machine_from(16, 4, memory_gib=80, peak_tflops=989)
    found, refused = candidates(_cfg(model), machine, SMALL)
    assert found and refused  # the space holds both (the test would prove nothing otherwise)
    kinds = set()
    for c in found:
        validate_layout(c.cfg, 16)  # raises on an invalid layout
        shape = mesh_shape(c.cfg, 16)
        assert math.prod(shape.values()) == 16
        assert all(v & (v - 1) == 0 for v in shape.values()), shape  # powers of two
        assert shape["tensor"] <= 4  # within a node
        p = c.cfg.parallel
        kinds.add((p.pp > 1 and (p.pipeline_schedule or "1f1b"), p.cp > 1 and p.cp_comm_type, p.ep > 1))
    schedules = {k[0] for k in kinds if k[0]}
    # MoE layers with --vpp run only under interleaved_1f1b (mjax/config/validate.py)
    expected = {"1f1b", "gpipe", "interleaved_1f1b"} | (set() if model.get("num_experts") else {"interleaved"})
    assert schedules == expected
    assert {k[1] for k in kinds if k[1]} == {"p2p", "all_gather", "a2a"}
    assert any(k[2] for k in kinds) == bool(model.get("num_experts"))


def test_the_refused_layouts_are_exactly_those_validation_refuses():
    """A layout the enumeration leaves out must be one validate_layout rejects: here every micro-batch size the
    enumeration tries on tp2 x pp2 x dp2 (8 devices, 16 sequences over dp 2 = 8 per shard)."""
    machine = machine_from(8, 8, memory_gib=80, peak_tflops=989)
    found, _ = candidates(_cfg(DENSE), machine, SMALL)
    proposed = {c.cfg.train.micro_batch_size for c in found
                if (c.cfg.parallel.tp, c.cfg.parallel.pp, c.cfg.parallel.dp, c.cfg.parallel.pipeline_schedule)
                == (2, 2, 2, "interleaved_1f1b")}
    for mbs in (1, 2, 4, 8):
        cfg = _cfg(DENSE, micro_batch_size=mbs).replace(parallel=dict(tp=2, pp=2, dp=2, vpp=2))
        try:
            validate_layout(cfg, 8)
            valid = True
        except ConfigError:
            valid = False
        assert (mbs in proposed) == valid, mbs  # 8 / mbs micro-batches: interleaved needs a multiple of pp >= pp


def test_a_layout_that_does_not_fit_is_rejected_with_its_reason():
    # 4 GPUs: ~400 layouts (tp, pp, cp, remat each varied), half the model traces that 8 GPUs' ~950 need
    cfg = _cfg(DENSE)
    roomy = machine_from(4, 4, memory_gib=80, peak_tflops=989)
    sizes = sorted(p.memory.total for p in make_plan(cfg, roomy, SMALL).ranked)
    limit = sizes[len(sizes) // 2] / GIB  # half of the layouts need more than this
    plan = make_plan(cfg, machine_from(4, 4, memory_gib=limit, peak_tflops=989), SMALL)
    assert plan.ranked and plan.rejected
    assert all(p.memory.total <= limit * GIB for p in plan.ranked)
    for p in plan.rejected:
        assert p.memory.total > limit * GIB
        assert p.reject == f"needs {p.memory.total / GIB:.1f} GiB > {limit:g}"
    times = [p.time.total_s for p in plan.ranked]
    assert times == sorted(times)


@pytest.mark.slow  # a train step or a plan compiled: over 7 s on 2 cores
def test_stages_of_different_dense_moe_patterns_are_rejected_not_ranked():
    """A dense first layer makes stage 0's pattern differ from the others' under --pp > 1: the memory model does not
    count those stages' slot copies, so such layouts are listed as rejects with that reason, never ranked."""
    roomy = machine_from(4, 4, memory_gib=80, peak_tflops=989)
    space = SearchSpace(remat_policies=("none",), vpp_sizes=(), max_micro_batch_size=1, cp_comm_types=("p2p",))
    plan = make_plan(_cfg(dict(MOE, moe_first_dense_layers=1)), roomy, space)
    assert plan.ranked and all(p.cfg.parallel.pp == 1 for p in plan.ranked)
    piped = [p for p in plan.rejected if p.cfg.parallel.pp > 1]
    assert piped and all(p.reject == UNMODELLED_STAGES for p in piped)
    assert any(p.cfg.parallel.pp > 1 for p in make_plan(_cfg(MOE), roomy, space).ranked)  # all-MoE stages: ranked


def test_state_bytes_match_a_hand_count_of_the_parameters():
    cfg = _cfg(DENSE)
    model = build_model(cfg.model, cfg.precision)
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(model.abstract_params()))
    plain = state_bytes(cfg.replace(parallel=dict(dp=8)), 8)
    assert plain["params"] == 4 * count and plain["grads"] == 4 * count
    assert 8 * count <= plain["optimizer"] <= 8 * count + 16  # Adam's two moments (+ its step count)
    sharded = state_bytes(cfg.replace(parallel=dict(fsdp=8, dp=1)), 8)
    assert sharded["params"] < plain["params"] / 4  # most of it split over 8 (norm scales stay whole)


def test_the_train_command_reproduces_the_layout():
    cfg = load_config("tiny").replace(parallel=dict(tp=2, pp=2, vpp=2), train=dict(micro_batch_size=2),
                                      execution=dict(remat_policy="full"))
    assert set(train_flags(cfg, "tiny")) == {"--tp=2", "--pp=2", "--vpp=2", "--micro_batch_size=2",
                                             "--remat_policy=full"}
