"""The 1F1B schedules as static tables: which forward and backward each pipeline device runs at each tick, and
where the activations and gradients it hands on wait until they are used. Built with numpy at trace time.

Each device runs Megatron-LM's order of operations (megatron/core/pipeline_parallel/schedules.py, interleaved):
`warmup` forwards, then pairs of one forward and one backward, then the remaining backwards, with
    warmup = min(2 (pp - s - 1) + (vpp - 1) pp, vpp M)          on device s,
forward k running virtual chunk (k // pp) % vpp of micro-batch (k // (pp vpp)) pp + k % pp, backward k the chunks
in reverse. (Megatron's non-interleaved warm-up is pp - s - 1 because its backward takes about twice a forward; in
equal ticks the factor 2 is what keeps the last stage busy.) Virtual stage v = c pp + s (chunk c of device s).

A tick is synchronous: each device runs at most one forward and one backward, the next ones in its order whose
inputs are there; what a device produces in a tick reaches its neighbour (ppermute) for the next tick, the last
stage's own forward output feeds its backward in the same tick. A tick lasts a forward if any device runs one plus
a backward if any device runs one, so the idle share is
    bubble = 1 - (device work) / (pp x total time) = (pp - 1) / (vpp M + pp - 1),
the interleaved 1F1B bubble, and the stage inputs a device keeps for its backward are bounded by pp and vpp, not M.

zero_bubble builds ZB-H1's tables (vpp = 1): the backward split into an input-gradient and a weight-gradient pass,
one operation per device per tick.
"""

import dataclasses
import functools

import numpy as np


def _order(pp: int, vpp: int, num: int, s: int) -> list[tuple[str, int, int]]:
    """Device s's operations in Megatron's order: ("F" | "B", chunk, micro-batch)."""
    total = vpp * num
    warmup = min(2 * (pp - s - 1) + (vpp - 1) * pp, total)

    def at(k, backward):
        chunk = (k // pp) % vpp
        return (vpp - 1 - chunk if backward else chunk), (k // (pp * vpp)) * pp + k % pp

    ops = [("F", *at(k, False)) for k in range(warmup)]
    for i in range(total - warmup):
        ops += [("F", *at(warmup + i, False)), ("B", *at(i, True))]
    return ops + [("B", *at(total - warmup + i, True)) for i in range(warmup)]


class _Slots:
    """Buffer slots of one device: taken when something arrives, given back when it is used."""

    def __init__(self):
        self.free, self.size = [], 0

    def take(self) -> int:
        if self.free:
            return self.free.pop()
        self.size += 1
        return self.size - 1

    def give(self, slot: int):
        self.free.append(slot)


@dataclasses.dataclass(frozen=True)
class Tables:
    """[ticks, pp] int32 tables; -1 where a device does nothing. f_*: the forward (chunk, micro-batch, input slot in
    `received` or -1 for the embedding, stash slot its input is kept in); b_*: the backward (chunk, micro-batch,
    gradient slot in `grads` or -1 for the loss, stash slot it reads); f_arrive / b_arrive: the slot where the
    activation / gradient a neighbour sent last tick is put (-1: none, or not wanted)."""
    f_chunk: np.ndarray
    f_micro: np.ndarray
    f_input: np.ndarray
    f_stash: np.ndarray
    b_chunk: np.ndarray
    b_micro: np.ndarray
    b_input: np.ndarray
    b_stash: np.ndarray
    f_arrive: np.ndarray
    b_arrive: np.ndarray
    received: int  # slots of the activation buffer
    grads: int  # slots of the gradient buffer
    stash: int  # slots of the stage-input buffer

    def bubble(self) -> float:
        """The idle share of the devices' time, a tick lasting one forward and/or one backward."""
        busy = (self.f_chunk >= 0).sum() + (self.b_chunk >= 0).sum()
        time = (self.f_chunk >= 0).any(1).sum() + (self.b_chunk >= 0).any(1).sum()
        return float(1 - busy / (time * self.f_chunk.shape[1]))

    def phases(self) -> list[tuple[bool, bool, int, int]]:
        """Runs of ticks alike in whether any forward / any backward runs: (forward, backward, start, stop)."""
        kinds = list(zip((self.f_chunk >= 0).any(1), (self.b_chunk >= 0).any(1)))
        runs, start = [], 0
        for t in range(1, len(kinds) + 1):
            if t == len(kinds) or kinds[t] != kinds[start]:
                runs.append((bool(kinds[start][0]), bool(kinds[start][1]), start, t))
                start = t
        return runs


@functools.cache
def one_f_one_b(pp: int, vpp: int, num: int) -> Tables:
    """The tables of 1F1B (vpp = 1) or interleaved 1F1B over `num` micro-batches (a multiple of pp when vpp > 1)."""
    if vpp > 1 and num % pp:
        raise ValueError(f"interleaved 1F1B needs the micro-batches ({num}) to be a multiple of --pp={pp}")
    orders = [_order(pp, vpp, num, s) for s in range(pp)]
    pos = [0] * pp
    f_done, b_done = {}, {}  # (device, chunk, micro) -> tick
    rows = []
    t = 0
    while any(pos[s] < len(orders[s]) for s in range(pp)):
        row = []
        for s in range(pp):
            did = []
            while pos[s] < len(orders[s]) and len(did) < 2:
                op, c, m = orders[s][pos[s]]
                if any(o == op for o, _, _ in did) or not _ready(op, s, c, m, t, pp, vpp, f_done, b_done):
                    break
                (f_done if op == "F" else b_done)[s, c, m] = t
                did.append((op, c, m))
                pos[s] += 1
            row.append(did)
        rows.append(row)
        t += 1
        if t > 4 * (vpp * num + pp) + 8:
            raise RuntimeError(f"the 1F1B schedule of pp={pp} vpp={vpp} M={num} does not finish")
    return _tables(rows, pp, vpp, f_done, b_done)


def _ready(op, s, c, m, t, pp, vpp, f_done, b_done) -> bool:
    never = 1 << 30
    if op == "F":
        if s == 0:
            return c == 0 or f_done.get((pp - 1, c - 1, m), never) < t
        return f_done.get((s - 1, c, m), never) < t
    if s == pp - 1:
        if c == vpp - 1:
            return f_done.get((s, c, m), never) <= t  # its own forward, this tick or before
        return b_done.get((0, c + 1, m), never) < t
    return b_done.get((s + 1, c, m), never) < t


def _tables(rows, pp, vpp, f_done, b_done) -> Tables:
    ticks = len(rows)
    arrays = {k: np.full((ticks, pp), -1, np.int32) for k in (
        "f_chunk", "f_micro", "f_input", "f_stash", "b_chunk", "b_micro", "b_input", "b_stash", "f_arrive",
        "b_arrive")}
    received, grads, stash = [_Slots() for _ in range(pp)], [_Slots() for _ in range(pp)], [_Slots() for _ in range(pp)]
    waiting_f, waiting_b, kept = {}, {}, {}  # (device, chunk, micro) -> slot
    for t, row in enumerate(rows):
        # What the neighbours produced last tick arrives now: keep what this device will use.
        if t > 0:
            for s in range(pp):
                for op, c, m in rows[t - 1][s]:
                    if op == "F" and not (s == pp - 1 and c == vpp - 1):
                        to, chunk = (s + 1, c) if s < pp - 1 else (0, c + 1)
                        waiting_f[to, chunk, m] = slot = received[to].take()
                        arrays["f_arrive"][t, to] = slot
                    if op == "B" and not (s == 0 and c == 0):
                        to, chunk = (s - 1, c) if s > 0 else (pp - 1, c - 1)
                        waiting_b[to, chunk, m] = slot = grads[to].take()
                        arrays["b_arrive"][t, to] = slot
        for s, did in enumerate(row):
            for op, c, m in did:
                if op == "F":
                    arrays["f_chunk"][t, s], arrays["f_micro"][t, s] = c, m
                    if (s, c, m) in waiting_f:
                        arrays["f_input"][t, s] = slot = waiting_f.pop((s, c, m))
                        received[s].give(slot)
                    kept[s, c, m] = arrays["f_stash"][t, s] = stash[s].take()
            for op, c, m in did:  # the backward after the forward: a stash slot is never shared within a tick
                if op == "B":
                    arrays["b_chunk"][t, s], arrays["b_micro"][t, s] = c, m
                    if (s, c, m) in waiting_b:
                        arrays["b_input"][t, s] = slot = waiting_b.pop((s, c, m))
                        grads[s].give(slot)
                    arrays["b_stash"][t, s] = slot = kept.pop((s, c, m))
                    stash[s].give(slot)
    size = lambda pools: max(1, max(p.size for p in pools))  # noqa: E731
    return Tables(**arrays, received=size(received), grads=size(grads), stash=size(stash))


@dataclasses.dataclass(frozen=True)
class ZeroBubbleTables:
    """[ticks, pp] int32 tables of ZB-H1; -1 where a device does nothing. A tick runs one operation per device: F
    (forward; f_input: slot in `received` or -1 for the embedding, f_stash: where its input is kept until W), B (input
    gradient; b_input: slot in `grads` or -1 for the loss, b_stash: the kept input, b_keep: slot in `kept` where its
    output gradient waits for W) or W (weight gradient; w_stash, w_keep: the input and output gradient it reads and
    frees). f_arrive / b_arrive as in Tables."""
    f_micro: np.ndarray
    f_input: np.ndarray
    f_stash: np.ndarray
    b_micro: np.ndarray
    b_input: np.ndarray
    b_stash: np.ndarray
    b_keep: np.ndarray
    w_micro: np.ndarray
    w_stash: np.ndarray
    w_keep: np.ndarray
    f_arrive: np.ndarray
    b_arrive: np.ndarray
    received: int  # slots of the activation buffer
    grads: int  # slots of the arriving-gradient buffer
    stash: int  # slots of the stage-input buffer (an input waits from its F to its W)
    kept: int  # slots of the output gradients waiting from their B to their W

    def bubble(self) -> float:
        """The idle share of the devices' time, every tick lasting one F, B or W (the paper's T_F = T_B = T_W)."""
        busy = sum((getattr(self, f"{op}_micro") >= 0).sum() for op in "fbw")
        return float(1 - busy / self.f_micro.size)

    def phases(self) -> list[tuple[bool, bool, bool, int, int]]:
        """At most three spans of ticks, (forward, input grad, weight grad, start, stop): up to the first W, up to the
        last F, the rest, each with every kind of operation run in it. Each span is one scan whose tick runs those
        kinds (masked on the devices doing something else); the finer runs of ZB-H1 (a dozen at pp = 4) would each
        compile a tick of their own."""
        ran = {op: (getattr(self, f"{op}_micro") >= 0).any(1) for op in "fbw"}
        ticks = len(ran["f"])
        cuts = sorted({0, int(np.argmax(ran["w"])), int(ticks - np.argmax(ran["f"][::-1])), ticks})
        return [(*(bool(ran[op][a:b].any()) for op in "fbw"), a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


@functools.cache
def zero_bubble(pp: int, num: int) -> ZeroBubbleTables:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023) over `num` >= pp micro-batches: the backward split
    into B (the input gradient, which the previous stage waits for) and W (the weight gradient, which nobody waits
    for). Each tick a device runs, in this order of preference, the oldest B whose output gradient is there; else its
    next F, if fewer than pp - s forwards wait for their B (1F1B's warm-up on device s) and fewer than 2 pp - 1 inputs
    wait for their W (the stash of 1F1B's tables); else the oldest W whose B is done. So the W passes fill what would
    be the cool-down bubble, and the idle share is (pp - 1) / (3 M + pp - 1), about a third of 1F1B's (pp - 1) /
    (M + pp - 1) for M >> pp."""
    if num < pp:
        raise ValueError(f"ZB-H1 needs at least --pp={pp} micro-batches, got {num}")
    never = 1 << 30
    done = {op: {} for op in "FBW"}  # op -> (device, micro) -> tick
    forwards, rows, t = [0] * pp, [], 0
    while len(done["W"]) < pp * num:
        row = []
        for s in range(pp):
            started = range(forwards[s])
            waiting_b = [m for m in started if (s, m) not in done["B"]]
            ready_b = [m for m in waiting_b if (done["F"][s, m] if s == pp - 1 else done["B"].get((s + 1, m), never))
                       < t]
            waiting_w = [m for m in started if (s, m) in done["B"] and (s, m) not in done["W"]]
            f_ok = (forwards[s] < num and len(waiting_b) < pp - s and len(waiting_b) + len(waiting_w) < 2 * pp - 1
                    and (s == 0 or done["F"].get((s - 1, forwards[s]), never) < t))
            row.append(("B", ready_b[0]) if ready_b else ("F", forwards[s]) if f_ok else
                       ("W", waiting_w[0]) if waiting_w else None)
        for s, op in enumerate(row):
            if op is not None:
                done[op[0]][s, op[1]] = t
                forwards[s] += op[0] == "F"
        rows.append(row)
        t += 1
        if t > 4 * (3 * num + pp):
            raise RuntimeError(f"the ZB-H1 schedule of pp={pp} M={num} does not finish")
    return _zero_bubble_tables(rows, pp)


def _zero_bubble_tables(rows, pp) -> ZeroBubbleTables:
    names = ("f_micro", "f_input", "f_stash", "b_micro", "b_input", "b_stash", "b_keep", "w_micro", "w_stash",
             "w_keep", "f_arrive", "b_arrive")
    arrays = {k: np.full((len(rows), pp), -1, np.int32) for k in names}
    pools = {k: [_Slots() for _ in range(pp)] for k in ("received", "grads", "stash", "kept")}
    waiting_f, waiting_b, stashed, kept = {}, {}, {}, {}  # (device, micro) -> slot
    for t, row in enumerate(rows):
        for s, op in enumerate(rows[t - 1] if t > 0 else ()):  # last tick's hand-offs arrive
            if op is not None and op[0] == "F" and s < pp - 1:
                waiting_f[s + 1, op[1]] = arrays["f_arrive"][t, s + 1] = pools["received"][s + 1].take()
            if op is not None and op[0] == "B" and s > 0:
                waiting_b[s - 1, op[1]] = arrays["b_arrive"][t, s - 1] = pools["grads"][s - 1].take()
        for s, op in enumerate(row):
            if op is None:
                continue
            kind, m = op
            if kind == "F":
                arrays["f_micro"][t, s] = m
                if (s, m) in waiting_f:
                    arrays["f_input"][t, s] = slot = waiting_f.pop((s, m))
                    pools["received"][s].give(slot)
                stashed[s, m] = arrays["f_stash"][t, s] = pools["stash"][s].take()
            elif kind == "B":
                arrays["b_micro"][t, s], arrays["b_stash"][t, s] = m, stashed[s, m]
                if (s, m) in waiting_b:
                    arrays["b_input"][t, s] = slot = waiting_b.pop((s, m))
                    pools["grads"][s].give(slot)
                kept[s, m] = arrays["b_keep"][t, s] = pools["kept"][s].take()
            else:
                arrays["w_micro"][t, s] = m
                arrays["w_stash"][t, s] = slot = stashed.pop((s, m))
                pools["stash"][s].give(slot)
                arrays["w_keep"][t, s] = slot = kept.pop((s, m))
                pools["kept"][s].give(slot)
    size = {k: max(1, max(p.size for p in v)) for k, v in pools.items()}
    return ZeroBubbleTables(**arrays, **size)
