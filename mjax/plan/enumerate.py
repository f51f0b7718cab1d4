"""Every layout of a config on a machine that train.py would accept: the mesh sizes (powers of two, tensor
parallelism within a node), the schedule, micro-batch, recomputation and FP8 choices, each kept only when
mjax.parallel.layout.validate_layout (the one validation of a run) passes it."""

import dataclasses
import itertools

from mjax.config import ConfigError
from mjax.parallel.layout import Batching, validate_layout
from mjax.config.validate import pipeline_schedule

REMAT_POLICIES = ("none", "selective", "full")
CP_COMM_TYPES = ("p2p", "all_gather", "a2a")


@dataclasses.dataclass(frozen=True)
class SearchSpace:
    """What the enumeration varies (each tuple: the values tried)."""
    remat_policies: tuple[str, ...] = REMAT_POLICIES
    fp8_recipes: tuple[str | None, ...] = (None,)
    cp_comm_types: tuple[str, ...] = CP_COMM_TYPES
    max_pp: int | None = None
    max_cp: int | None = None
    max_micro_batch_size: int | None = None
    vpp_sizes: tuple[int, ...] = (2, 4)
    sequence_parallel: tuple[bool, ...] = (True,)  # with tp > 1 (Megatron's usual choice); add False to compare


@dataclasses.dataclass(frozen=True)
class Candidate:
    cfg: object  # the Config train.py would run
    batching: Batching

    @property
    def name(self) -> str:
        return layout_name(self.cfg)


def powers_of_two(limit: int, divides: int | None = None) -> list[int]:
    out, v = [], 1
    while v <= limit:
        if divides is None or divides % v == 0:
            out.append(v)
        v *= 2
    return out


def layout_name(cfg) -> str:
    p, t, pr = cfg.parallel, cfg.train, cfg.precision
    parts = [f"tp{p.tp}" + ("sp" if p.sequence_parallel and p.tp > 1 else "")]
    if p.pp > 1:
        parts.append(f"pp{p.pp}" + (f"v{p.vpp}" if p.vpp > 1 else "") + f"/{pipeline_schedule(p)}")
    if p.cp > 1:
        parts.append(f"cp{p.cp}/{p.cp_comm_type}")
    if p.ep > 1 or p.expert_tensor_parallel_size is not None:
        parts.append(f"ep{p.ep}" + (f"etp{p.expert_tensor_parallel_size}" if p.expert_tensor_parallel_size else ""))
    if p.fsdp > 1:
        parts.append(f"fsdp{p.fsdp}")
    parts.append(f"dp{p.dp}" + ("z1" if p.use_distributed_optimizer else ""))
    parts.append(f"mbs{t.micro_batch_size}")
    parts.append(f"remat={cfg.execution.remat_policy}")
    if pr.fp8_recipe:
        parts.append(f"fp8={pr.fp8_recipe}")
    return " ".join(parts)


def _meshes(cfg, machine, space):
    """(tp, pp, cp, ep, fsdp, dp) with product num_gpus, each a power of two."""
    n, m = machine.num_gpus, cfg.model
    experts = m.num_experts or 1
    for tp in powers_of_two(min(machine.gpus_per_node, n), n):
        for pp in powers_of_two(min(space.max_pp or n, n // tp, m.num_layers), n // tp):
            for cp in powers_of_two(min(space.max_cp or n, n // (tp * pp)), n // (tp * pp)):
                rest = n // (tp * pp * cp)
                for ep in powers_of_two(min(rest, experts), experts):
                    if rest % ep:
                        continue
                    data = rest // ep
                    # the remaining data-parallel devices go to plain dp or all to fsdp (mixed splits cost the
                    # same bytes per device as one of the two and are not worth the search)
                    yield from ((tp, pp, cp, ep, 1, data), *(((tp, pp, cp, ep, data, 1),) if data > 1 else ()))


def _schedules(pp, space):
    if pp == 1:
        return [(1, None)]
    return [(1, "1f1b"), (1, "gpipe"), *[(v, s) for v in space.vpp_sizes for s in ("interleaved_1f1b", "interleaved")]]


def candidates(cfg, machine, space: SearchSpace = SearchSpace()) -> tuple[list[Candidate], int]:
    """(the layouts validate_layout accepts, how many it refused). The base config's own fields other than the
    ones varied here (model, sequence length, global batch, kernels) are kept."""
    accepted, refused = [], 0
    for tp, pp, cp, ep, fsdp, dp in _meshes(cfg, machine, space):
        expert_tps = [None] + ([1] if ep > 1 and tp > 1 else [])
        sps = space.sequence_parallel if tp > 1 else (False,)
        zero1s = (False, True) if dp > 1 else (False,)
        comms = space.cp_comm_types if cp > 1 else ("p2p",)
        shards = dp * fsdp * ep
        per_shard = cfg.train.global_batch_size // shards if cfg.train.global_batch_size % shards == 0 else 0
        micro = powers_of_two(min(per_shard, space.max_micro_batch_size or per_shard), per_shard) if per_shard else [1]
        for (vpp, schedule), etp, sp, zero1, comm, mbs, remat, fp8 in itertools.product(
                _schedules(pp, space), expert_tps, sps, zero1s, comms, micro, space.remat_policies,
                space.fp8_recipes):
            c = cfg.replace(
                parallel=dict(tp=tp, pp=pp, vpp=vpp, pipeline_schedule=schedule, cp=cp, cp_comm_type=comm, ep=ep,
                              expert_tensor_parallel_size=etp, fsdp=fsdp, dp=dp, sequence_parallel=sp,
                              use_distributed_optimizer=zero1),
                train=dict(micro_batch_size=mbs), execution=dict(remat_policy=remat),
                precision=dict(fp8_recipe=fp8))
            try:
                accepted.append(Candidate(c, validate_layout(c, machine.num_gpus)))
            except ConfigError:
                refused += 1
    return accepted, refused
