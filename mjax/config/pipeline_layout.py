"""Which transformer layers each pipeline stage holds: Megatron's even split, its uneven first/last stages, the
embedding / loss counted as a layer of the split, and its explicit layout string. Pure arithmetic (no JAX): the
config validation, the pipeline (mjax/parallel/pipeline_placement.py) and the logs share one answer.

Layers are numbered in virtual-stage order, as in Megatron: virtual stage v = c pp + s (chunk c of device s) holds
the `counts[v]` layers after those of virtual stages 0 .. v - 1. The embedding always runs on virtual stage 0 and
the output layer and loss on the last one; the flags below only move the transformer layers.

  (none)                                  num_layers / (pp vpp) layers on every virtual stage
  --decoder_first_pipeline_num_layers=F   device 0 holds F layers, --decoder_last_pipeline_num_layers the last device;
                                          the rest split evenly over the other devices; each device's split evenly
                                          over its vpp chunks
  --account_for_embedding_in_pipeline_split / --account_for_loss_in_pipeline_split
                                          the embedding / the loss count as one layer: num_layers + 1 (+ 1) split
                                          evenly, then virtual stage 0 (the last one) holds one transformer layer less
  --pipeline_model_parallel_layout=S      Megatron's string: "|" ends a virtual stage, E the embedding, t a
                                          transformer layer, m a multi-token-prediction depth, L the loss,
                                          "(...)*n" and "x*n" repeat, "," is cosmetic; stage i of the string is
                                          virtual stage i, so it has pp x vpp stages. The m's run with the loss, so
                                          they sit in the last stage, before its L
"""

import dataclasses
import functools
import re

from mjax.config.base import ConfigError

LAYOUT = "pipeline_model_parallel_layout"
FIRST, LAST = "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"
WITH_EMBEDDING, WITH_LOSS = "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"
_REPEAT_GROUP = re.compile(r"\(([^()]*)\)\*(\d+)")  # an innermost "(...)*n"
_REPEAT_ONE = re.compile(r"([^()*])\*(\d+)")  # "x*n"


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """The transformer layers of each virtual stage v = c pp + s, v = 0 .. pp vpp - 1."""
    pp: int
    vpp: int
    counts: tuple[int, ...]
    mtp: int = 0  # the multi-token-prediction depths the layout string places (m), on the last virtual stage

    @property
    def even(self) -> bool:
        return len(set(self.counts)) == 1

    def first_layer(self, v: int) -> int:
        return sum(self.counts[:v])

    def layers(self, s: int, c: int) -> range:
        """The layers of chunk c of device s."""
        v = c * self.pp + s
        return range(self.first_layer(v), self.first_layer(v) + self.counts[v])

    def describe(self) -> str:
        """One line: the layer counts of each device's chunks, e.g. "device 0: 3 | device 1: 4"."""
        return " | ".join(f"device {s}: " + "+".join(str(self.counts[c * self.pp + s]) for c in range(self.vpp))
                          for s in range(self.pp))


def parse_layout(text: str) -> list[list[str]]:
    """Megatron's layout string -> the items ("E", "t", "m", "L") of each stage, in string order."""
    expanded = text.replace(",", "")  # Megatron: commas are cosmetic
    while _REPEAT_GROUP.search(expanded):  # innermost groups first, so groups may nest
        expanded = _REPEAT_GROUP.sub(lambda g: g.group(1) * int(g.group(2)), expanded)
    expanded = _REPEAT_ONE.sub(lambda g: g.group(1) * int(g.group(2)), expanded)
    bad = sorted(set(expanded) - set("EtmL|"))
    if bad:
        grouping = " (a group needs its repeat count: \"(tt|)*3\")" if {"(", ")", "*"} & set(bad) else ""
        raise ConfigError(f"--{LAYOUT}={text!r}: cannot read {''.join(bad)!r}{grouping}; use E (embedding), "
                          "t (transformer layer), m (multi-token-prediction depth), L (loss), | (stage boundary), "
                          "(...)*n and x*n (repeats)")
    return [list(stage) for stage in expanded.split("|")]


@functools.cache
def stage_layout(p, num_layers: int) -> StageLayout:
    """The layers of each virtual stage for ParallelConfig `p`; a ConfigError naming the flag when they do not add up
    (Megatron's rules: transformer_config.py and transformer_block.py)."""
    first, last = getattr(p, FIRST), getattr(p, LAST)
    with_embedding, with_loss = getattr(p, WITH_EMBEDDING), getattr(p, WITH_LOSS)
    if getattr(p, LAYOUT) is not None:
        others = [f"--{n}" for n, v in ((FIRST, first), (LAST, last), (WITH_EMBEDDING, with_embedding),
                                        (WITH_LOSS, with_loss)) if v]
        if others:
            raise ConfigError(f"--{LAYOUT} places every layer itself; drop {' and '.join(others)} (as in Megatron)")
        return _from_layout(getattr(p, LAYOUT), p.pp, p.vpp, num_layers)
    if first is not None or last is not None:
        if with_embedding or with_loss:
            raise ConfigError(f"--{FIRST} / --{LAST} set the first / last stage's layers themselves; drop "
                              f"--{WITH_EMBEDDING} and --{WITH_LOSS} (as in Megatron), or use --{LAYOUT}")
        return _uneven(p.pp, p.vpp, num_layers, first, last)
    if with_embedding or with_loss:
        return _accounted(p.pp, p.vpp, num_layers, with_embedding, with_loss)
    if num_layers % (p.pp * p.vpp):
        raise ConfigError(
            f"--model.num_layers={num_layers} is not divisible by --pp={p.pp} x --vpp={p.vpp}: every (virtual) "
            f"pipeline stage holds the same number of layers unless --{FIRST} / --{LAST}, --{WITH_EMBEDDING} / "
            f"--{WITH_LOSS} or --{LAYOUT} says otherwise; change one of them")
    return StageLayout(p.pp, p.vpp, (num_layers // (p.pp * p.vpp),) * (p.pp * p.vpp))


def _per_device(pp: int, vpp: int, per_device: list[int]) -> tuple[int, ...]:
    """Each device's layers split evenly over its chunks -> the counts in virtual-stage order."""
    return tuple(per_device[v % pp] // vpp for v in range(pp * vpp))


def _uneven(pp, vpp, num_layers, first, last) -> StageLayout:
    fixed = {0: (FIRST, first)} if first is not None else {}
    if last is not None:
        if pp == 1 and first is not None:
            raise ConfigError(f"--{FIRST} and --{LAST} name two stages, and --pp=1 has one; drop one of them")
        fixed[pp - 1] = (LAST, last)
    for name, n in fixed.values():
        if n <= 0:
            raise ConfigError(f"--{name}={n} must be positive (as in Megatron); an empty stage needs --{LAYOUT}")
        if n % vpp:
            raise ConfigError(f"--{name}={n} is not divisible by --vpp={vpp}: the device's layers split evenly over "
                              "its virtual stages")
    middle_layers = num_layers - sum(n for _, n in fixed.values())
    middle = pp - len(fixed)
    given = " + ".join(f"--{name}={n}" for name, n in fixed.values())
    if middle_layers < 0 or bool(middle_layers) != bool(middle):
        raise ConfigError(f"{given} leaves {middle_layers} of the --model.num_layers={num_layers} layers for the "
                          f"{middle} other pipeline stage(s) of --pp={pp}; change them so every other stage gets "
                          "layers (or none is left over)")
    if middle and middle_layers % (middle * vpp):
        raise ConfigError(f"{given} leaves {middle_layers} of the --model.num_layers={num_layers} layers, which do "
                          f"not split evenly over the other {middle} stage(s) x --vpp={vpp} (Megatron splits them "
                          f"evenly); change them, or place the layers with --{LAYOUT}")
    per_device = [fixed[s][1] if s in fixed else middle_layers // middle for s in range(pp)]
    return StageLayout(pp, vpp, _per_device(pp, vpp, per_device))


def _accounted(pp, vpp, num_layers, with_embedding, with_loss) -> StageLayout:
    flags = " and ".join(f"--{n}" for n, v in ((WITH_EMBEDDING, with_embedding), (WITH_LOSS, with_loss)) if v)
    total = num_layers + int(with_embedding) + int(with_loss)
    if total % (pp * vpp):
        raise ConfigError(f"{flags}: --model.num_layers={num_layers} + {total - num_layers} = {total} is not "
                          f"divisible by --pp={pp} x --vpp={vpp}; change one of them")
    counts = [total // (pp * vpp)] * (pp * vpp)
    counts[0] -= int(with_embedding)  # never below 0: total >= pp x vpp, and one stage takes both only at pp vpp = 1
    counts[-1] -= int(with_loss)
    return StageLayout(pp, vpp, tuple(counts))


def _from_layout(text, pp, vpp, num_layers) -> StageLayout:
    stages = parse_layout(text)
    if len(stages) % pp:
        raise ConfigError(f"--{LAYOUT}={text!r} has {len(stages)} stages, not a multiple of --pp={pp} (stage i is "
                          "virtual stage i: chunk i // pp of device i % pp)")
    if len(stages) // pp != vpp:
        raise ConfigError(f"--{LAYOUT}={text!r} has {len(stages)} stages = --pp={pp} x {len(stages) // pp} virtual "
                          f"stages per device; set --vpp={len(stages) // pp} (now {vpp})")
    items = [item for stage in stages for item in stage]
    if items.count("E") != 1 or stages[0][:1] != ["E"]:
        raise ConfigError(f"--{LAYOUT}={text!r}: the embedding E must be there once, first in the first stage "
                          "(where it runs)")
    if items.count("L") != 1 or stages[-1][-1:] != ["L"]:
        raise ConfigError(f"--{LAYOUT}={text!r}: the loss L must be there once, last in the last stage (where it "
                          "runs)")
    if items.count("t") != num_layers:
        raise ConfigError(f"--{LAYOUT}={text!r} places {items.count('t')} transformer layers (t), and "
                          f"--model.num_layers={num_layers}; make them agree")
    mtp = items.count("m")
    if mtp and stages[-1][-1 - mtp:-1] != ["m"] * mtp:
        raise ConfigError(f"--{LAYOUT}={text!r}: the multi-token-prediction depths m run where the loss runs, so they "
                          "go together at the end of the last stage, just before its L (e.g. \"Ett|ttmL\")")
    return StageLayout(pp, vpp, tuple(stage.count("t") for stage in stages), mtp)
