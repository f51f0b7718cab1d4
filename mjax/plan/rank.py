"""One prediction per candidate layout, the ranking (fastest first among those that fit; the rest rejected with
their reason), the table, the JSON, and the train.py command of a layout."""

import dataclasses

from mjax.config import ConfigError, load_config
from mjax.config.flags import _fields
from mjax.config.pipeline_layout import stage_layout
from mjax.parallel.pipeline_placement import needs_placement
from mjax.plan.cost import StepTime, step_time
from mjax.plan.enumerate import SearchSpace, candidates
from mjax.plan.memory import Memory, memory
from mjax.plan.states import state_bytes

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Prediction:
    name: str
    cfg: object
    batching: object
    memory: Memory
    time: StepTime
    reject: str | None  # why it cannot run, or None

    def tokens_per_s(self) -> float:
        return self.cfg.train.global_batch_size * self.cfg.train.seq_length / self.time.total_s

    def mfu(self, machine) -> float:
        return self.time.model_flops / self.time.total_s / machine.num_gpus / (machine.peak_tflops * 1e12)

    def row(self, machine) -> dict:
        return {"layout": self.name, "gib_per_device": self.memory.total / GIB,
                "memory_gib": {k: v / GIB for k, v in dataclasses.asdict(self.memory).items()},
                "step_time_s": self.time.total_s, "compute_s": self.time.compute_s, "memory_s": self.time.memory_s,
                "bubble": self.time.bubble,
                "comm_s": self.time.comm_s, "tokens_per_s": self.tokens_per_s(), "mfu": self.mfu(machine),
                "micro_batches": self.batching.micro_batches, "reject": self.reject}


UNMODELLED_STAGES = ("stages of different dense/MoE patterns (--moe_first_dense_layers with --pp > 1): the memory "
                     "model does not count the copy of each device's layer slots")


def predict(candidate, machine) -> Prediction:
    cfg, batching = candidate.cfg, candidate.batching
    mem = memory(cfg, batching, machine.num_gpus, on_gpu=True)
    time = step_time(cfg, batching, state_bytes(cfg, machine.num_gpus), machine)
    limit = machine.memory_gib * GIB
    reject = f"needs {mem.total / GIB:.1f} GiB > {machine.memory_gib:g}" if mem.total > limit else None
    p = cfg.parallel
    if p.pp > 1 and needs_placement(stage_layout(p, cfg.model.num_layers), tuple(cfg.model.moe_layer_pattern())):
        reject = UNMODELLED_STAGES  # never ranked on a prediction known to miss
    return Prediction(candidate.name, cfg, batching, mem, time, reject)


@dataclasses.dataclass(frozen=True)
class Plan:
    ranked: list  # Predictions that fit, fastest first
    rejected: list  # Predictions that do not, smallest memory first
    refused: int  # layouts validate_layout refused (never proposed)


def make_plan(cfg, machine, space: SearchSpace = SearchSpace()) -> Plan:
    if cfg.model.mtp_depth:  # the activation trace runs the model's forward, not the MTP depths after it
        raise ConfigError(f"--mtp_num_layers={cfg.model.mtp_num_layers}: the planner does not model the multi-token "
                          "prediction blocks' memory yet; plan without --mtp_num_layers")
    found, refused = candidates(cfg, machine, space)
    predictions = [predict(c, machine) for c in found]
    ranked = sorted((p for p in predictions if p.reject is None), key=lambda p: (p.time.total_s, p.memory.total))
    rejected = sorted((p for p in predictions if p.reject is not None), key=lambda p: p.memory.total)
    return Plan(ranked, rejected, refused)


def format_table(plan: Plan, machine, top: int = 10, rejects: int = 5) -> str:
    head = f"{'#':>3} {'layout':<62} {'GiB/dev':>8} {'step s':>8} {'tokens/s':>12} {'MFU':>6} {'bubble':>6}"
    lines = [head, "-" * len(head)]
    for i, p in enumerate(plan.ranked[:top], 1):
        lines.append(f"{i:>3} {p.name:<62} {p.memory.total / GIB:>8.1f} {p.time.total_s:>8.3f} "
                     f"{p.tokens_per_s():>12,.0f} {p.mfu(machine):>6.1%} {p.time.bubble:>6.1%}")
    if not plan.ranked:
        lines.append("    no layout fits: see the rejects below")
    if plan.rejected:
        lines.append(f"rejected ({len(plan.rejected)}; the {min(rejects, len(plan.rejected))} closest to fitting):")
        lines += [f"    {p.name:<62} {p.reject}" for p in plan.rejected[:rejects]]
    lines.append(f"{len(plan.ranked) + len(plan.rejected)} layouts predicted; {plan.refused} refused by train.py's "
                 "validation (never proposed)")
    return "\n".join(lines)


def train_flags(cfg, preset: str) -> list[str]:
    """The flags that turn `preset` into `cfg`, by their short names where they have one."""
    base = load_config(preset)
    flags = []
    for section, f, _ in _fields():
        value, was = getattr(getattr(cfg, section), f.name), getattr(getattr(base, section), f.name)
        if value == was:
            continue
        name = f.metadata.get("flag", f"{section}.{f.name}")
        text = ("true" if value else "false") if isinstance(value, bool) else (
            "none" if value is None else ",".join(map(str, value)) if isinstance(value, tuple) else str(value))
        flags.append(f"--{name}={text}")
    return flags


def train_command(cfg, preset: str) -> str:
    return " ".join(["python scripts/train.py", f"--config={preset}", *train_flags(cfg, preset)])
