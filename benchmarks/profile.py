"""Where a compiled step spends device time: a jax.profiler trace read back and summed per kernel and category.

Each device event that XLA tags with its HLO instruction (`hlo_op`) is counted; the instruction's `op_name`
metadata in the compiled HLO says which part of the model launched it (attention, MLP, loss, optimizer...).
On GPU the events are the kernels on the device's streams; on CPU they are the executed HLO thunks.
"""

import collections
import dataclasses
import glob
import re
import tempfile
import time

import jax
import numpy as np
from jax.profiler import ProfileData

# Kernel name -> kind of work (GPU kernel names of cuBLAS/cuDNN/NCCL/XLA; first match wins).
_KERNEL_KINDS = (
    ("collective", re.compile(r"nccl|all_reduce|all-reduce|allgather|reduce_scatter|collective", re.I)),
    ("attention", re.compile(r"cudnn|fmha|flash|sdpa|attention", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|nvjet|xmma|cublas|sm90_|dot|matmul", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy", re.I)),
)
# op_name scope -> part of the model (first match wins): mjax's jax.named_scope labels.
_SCOPES = tuple((scope, re.compile(rf"\b{scope}\b")) for scope in
                ("optimizer", "loss", "embedding", "attention", "mlp", "norm"))
# Host-side control flow whose events enclose the ops they run (counting both would count twice).
_CONTAINER = re.compile(r"(while|call|conditional)(\.\d+)?$")


@dataclasses.dataclass
class Profile:
    steps: int
    wall_ms_per_step: float
    busy_ms_per_step: float  # device time covered by at least one counted event, per step
    by_kind: dict  # kind -> ms per step
    by_scope: dict  # model part -> ms per step
    top_kernels: list  # [(kernel name, kind, scope, ms per step, launches per step, HLO op: opcode and op_name tail)]
    matched: float  # fraction of the device time whose HLO op was found in the compiled module's text
    unmatched_examples: list  # a few (kernel, hlo_op) that were not, to see why
    exposed_collective_ms: float  # collective kernel time during which no compute kernel ran, per step

    def format(self) -> str:
        lines = [f"per step: wall {self.wall_ms_per_step:.1f} ms, device busy {self.busy_ms_per_step:.1f} ms "
                 f"({self.busy_ms_per_step / self.wall_ms_per_step:.0%})"]
        for title, table in (("kind", self.by_kind), ("model part", self.by_scope)):
            lines.append(f"  by {title}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in _desc(table)))
        if self.by_kind.get("collective"):
            lines.append(f"  collectives: {self.by_kind['collective']:.1f} ms, of which "
                         f"{self.exposed_collective_ms:.1f} ms with no compute kernel running (not overlapped)")
        lines.append(f"  HLO ops found for {self.matched:.0%} of the time; "
                     f"not found e.g. {self.unmatched_examples[:3]}")
        lines.append(f"  {'kernel':<48} {'kind':>10} {'part':>10} {'ms/step':>8} {'calls':>6}  HLO op")
        for name, kind, scope, ms, calls, op in self.top_kernels[:40]:
            lines.append(f"  {name[:48]:<48} {kind:>10} {scope:>10} {ms:>8.2f} {calls:>6.0f}  {op}")
        return "\n".join(lines)


def _desc(table):
    return sorted(table.items(), key=lambda kv: -kv[1])


def kernel_kind(name: str, hlo_opcode: str = "", primitive: str = "") -> str:
    """The kind of work of a kernel (or CPU thunk) by its name, its HLO opcode, or (for a fusion) the jax primitive
    its op_name ends in: XLA:CPU runs dots inside library fusions (`ynn_fusion.12`, opcode `fusion`, op_name
    `.../dot_general`)."""
    for kind, pattern in _KERNEL_KINDS:
        if pattern.search(name) or pattern.search(hlo_opcode) or pattern.search(primitive):
            return kind
    return "fusion/other"


def op_scopes(hlo_text: str) -> dict:
    """HLO instruction name -> (opcode, op_name metadata) from a compiled module's text."""
    out = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$", hlo_text, re.M):
        opcode = re.search(r"([a-z][\w\-]*)\(", m.group(2))
        op_name = re.search(r'op_name="([^"]*)"', m.group(2))
        out[m.group(1)] = (opcode.group(1) if opcode else "", op_name.group(1) if op_name else "")
    return out


def scope_of(op_name: str) -> str:
    for scope, pattern in _SCOPES:
        if pattern.search(op_name):
            return scope
    return "other"


def _first_device_plane(data):
    """The trace's plane of its first device (lowest name, e.g. /device:GPU:0), or None where it has none."""
    return min((p for p in data.planes if p.name.startswith("/device:")), key=lambda p: p.name, default=None)


def _device_events(data):
    """(kernel name, hlo_op, start ns, end ns) of every event tagged with an HLO op, on the first device's plane
    (the host's where there is no device plane): per-device numbers, as the benchmark reports."""
    device = _first_device_plane(data)
    planes = [device] if device else [p for p in data.planes if p.name.startswith("/host:CPU")]
    for plane in planes:
        for line in plane.lines:
            for ev in line.events:
                stats = dict(ev.stats)
                if "hlo_op" in stats and not _CONTAINER.match(str(stats["hlo_op"])):
                    yield ev.name, str(stats["hlo_op"]), ev.start_ns, ev.end_ns


def _hlo_name(kernel: str, hlo_op: str, scopes: dict) -> str | None:
    """The HLO instruction of an event: its hlo_op, or (inside a CUDA-graph command buffer, whose events carry
    the buffer's name) the instruction its kernel is named after, `loop_add_fusion_3` for `loop_add_fusion.3`."""
    for name in (hlo_op, re.sub(r"_(\d+)$", r".\1", kernel), kernel):
        if name in scopes:
            return name
    return None


def _merged(intervals) -> list[list[int]]:
    """The union of (start, end) intervals as sorted, disjoint [start, end] pairs."""
    merged = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return merged


def _exposed_ns(intervals, cover):
    """Time of `intervals` not covered by the union of `cover` (both lists of (start, end))."""
    union = _merged(cover)
    return sum((e - s) - sum(max(0, min(e, ce) - max(s, cs)) for cs, ce in union) for s, e in intervals)


def trace(run_step, steps: int):
    """(ProfileData, wall seconds) of `steps` calls of `run_step()` (which must block) under jax.profiler."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            t0 = time.perf_counter()
            for _ in range(steps):
                run_step()
            wall = time.perf_counter() - t0
        return ProfileData.from_file(glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0]), wall


def profile_step(run_step, steps: int, hlo_text: str, top: int = 150) -> Profile:
    """Traces `steps` calls of `run_step()` (which must block) and sums device time per kernel / kind / part."""
    data, wall = trace(run_step, steps)
    events = list(_device_events(data))
    scopes = op_scopes(hlo_text)
    per_kernel = collections.defaultdict(lambda: [0.0, 0])
    by_kind, by_scope = collections.Counter(), collections.Counter()
    found_ms, unmatched = 0.0, {}
    compute, collective = [], []
    for name, hlo_op, start, end in events:
        ms = (end - start) / 1e6 / steps
        instruction = _hlo_name(name, hlo_op, scopes)
        if instruction is not None:
            found_ms += ms
        elif len(unmatched) < 5:
            unmatched.setdefault(name, hlo_op)
        opcode, op_name = scopes.get(instruction, ("", ""))
        primitive = op_name.rsplit("/", 1)[-1] if opcode == "fusion" else ""
        kind, scope = kernel_kind(name, opcode, primitive), scope_of(op_name)
        op = f"{opcode} {'/'.join(op_name.split('/')[-2:])}"[:70]
        per_kernel[(name, kind, scope, op)][0] += ms
        per_kernel[(name, kind, scope, op)][1] += 1 / steps
        by_kind[kind] += ms
        by_scope[scope] += ms
        (collective if kind == "collective" else compute).append((start, end))
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:top]
    busy = sum(e - s for s, e in _merged(compute + collective)) / 1e6 / steps
    total = sum(by_kind.values()) or 1.0
    return Profile(steps, wall * 1e3 / steps, busy, dict(by_kind), dict(by_scope),
                   [(n, k, s, ms, calls, op) for (n, k, s, op), (ms, calls) in ranked], found_ms / total,
                   list(unmatched.items()), _exposed_ns(collective, compute) / 1e6 / steps)


def stream_kernels(data):
    """(name, start ns, end ns) of every event on the first GPU's streams of a trace (kernels, copies, memsets;
    tagged with an HLO op or not, unlike profile_step's), in start order."""
    plane = _first_device_plane(data)
    if plane is None or not plane.name.startswith("/device:GPU"):
        raise ValueError("no GPU in the trace")
    events = [(ev.name, ev.start_ns, ev.end_ns) for line in plane.lines if "stream" in line.name.lower()
              for ev in line.events]
    return sorted(events, key=lambda e: e[1])


def step_table(events, steps):
    """Per kernel position in a step: (name, mean ms running, mean ms idle before it); the step's span in ms.
    Every step must launch the same kernels in the same order."""
    if len(events) % steps:
        raise ValueError(f"{len(events)} kernels do not split into {steps} steps")
    per = len(events) // steps
    split = [events[s * per:(s + 1) * per] for s in range(steps)]
    if any([e[0] for e in step] != [e[0] for e in split[0]] for step in split):
        raise ValueError("the steps launched different kernels: the trace does not split into equal steps")
    run, idle, span = np.zeros(per), np.zeros(per), 0.0
    for step in split:
        span += (step[-1][2] - step[0][1]) / 1e6
        for i, (_, start, end) in enumerate(step):
            run[i] += (end - start) / 1e6
            idle[i] += max(0, start - step[i - 1][2]) / 1e6 if i else 0.0
    return [(events[i][0], run[i] / steps, idle[i] / steps) for i in range(per)], span / steps
