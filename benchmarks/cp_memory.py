"""Per-device memory of compiled (never run) train steps under context parallelism: rows sequence length, columns cp.

    JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES=16 python -m benchmarks.cp_memory --json_out=cp_memory.json
    JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES=8 python -m benchmarks.cp_memory --seqs=8k --cps=4 --num_layers=2

Each (sequence, cp) is one train step of --config (llama3-8b), built as training builds it (mjax.train.loop.build)
and compiled ahead of time from ShapeDtypeStructs with the real shardings; nothing is allocated. Layout: cp x fsdp =
--num_devices (FSDP shards params, gradients and optimizer state over `fsdp` only, not over `context`), micro
batch 1, global batch = fsdp (one sequence per data-parallel rank), bf16 compute, --attention_impl=pallas
(interpreted off GPU: compile-only here), so no T x T logits exist. Entries are XLA's memory analysis per device:
temporaries, and total = arguments + outputs - donated + temporaries (mjax.train.startup.compiled_memory, the
start-up log's "expected peak"). Each column also gets the step compiled at 32 tokens per device: its temporaries
are those of the state (gradients, optimizer update, gathered weights), which do not depend on the sequence.

Beside each cell, an analytic estimate of the activations one device holds, t = seq / cp tokens per device:
t x (layers x what --remat_policy saves per token and layer + one layer's full set (the layer recomputed in the
backward; none with --remat_policy=none) + the fp32 logits and their gradient (reference cross entropy; fused:
one chunk of them in all, and the output layer's input gradient its forward saves)). It falls exactly 1/cp; the
measured temporaries fall with it once the activations outgrow the state's temporaries (XLA's peak is the larger
of the backward's and the optimizer update's live sets).

A case that does not compile shows why in its cell, and the grid goes on. cp = --num_devices (no other mesh axis
larger than 1) fails today with --attention_impl=pallas (the per-shard kernel's custom partitioning sees an
all-manual sharding); hence the 16 devices of the first command, so that cp 8 runs beside fsdp 2.
"""

import json
import re
import time

from absl import flags

from benchmarks.cli import BadInput, run_main

from mjax.xla_flags import apply_defaults

apply_defaults()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from mjax.config import load_config  # noqa: E402
from mjax.train.loop import build  # noqa: E402
from mjax.train.startup import compiled_memory  # noqa: E402

flags.DEFINE_string("config", "llama3-8b", "Preset or config file (mjax.config.load_config).")
flags.DEFINE_list("seqs", ["8k", "16k", "32k", "64k", "128k"], "Sequence lengths (rows); 8k = 8192.")
flags.DEFINE_list("cps", ["1", "2", "4", "8"], "Context-parallel sizes (columns); each divides --num_devices.")
flags.DEFINE_integer("num_devices", None, "Devices of the layout (cp x fsdp); default: all JAX devices.")
flags.DEFINE_enum("remat_policy", "full", ["none", "selective", "full"], "Activation recomputation.")
flags.DEFINE_string("cp_comm_type", "p2p", "--cp_comm_type of the steps (p2p, all_gather, a2a).")
flags.DEFINE_string("cross_entropy_impl", None, "--cross_entropy_impl; default: the config's.")
flags.DEFINE_integer("num_layers", None, "Override the config's layer count (quicker compiles).")
flags.DEFINE_string("json_out", "", "Write every case (bytes, compile seconds, estimate, error) as JSON here.")
FLAGS = flags.FLAGS

# The tests' fast XLA options (tests/helpers/train_utils.py FAST_COMPILE): half the compile time on CPU, and the
# same memory analysis (llama3-8b, 8k tokens, cp 4: 33.68 GiB of temporaries either way).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
STATE_TOKENS = 32  # tokens per device of the state-only compile: 16 per load-balancing chunk
UNITS = {"GiB": 2**30, "MiB": 2**20}


def parse_length(text: str) -> int:
    match = re.fullmatch(r"(\d+)(k?)", text.strip().lower())
    if not match:
        raise BadInput(f"--seqs: {text!r} is not a length (e.g. 8192 or 8k)")
    return int(match.group(1)) * (1024 if match.group(2) else 1)


def length_label(seq: int) -> str:
    return f"{seq // 1024}k" if seq % 1024 == 0 else str(seq)


def case_config(base, seq: int, cp: int, num_devices: int):
    fsdp = num_devices // cp
    execution = dict(remat_policy=FLAGS.remat_policy, attention_impl="pallas")
    if FLAGS.cross_entropy_impl is not None:
        execution["cross_entropy_impl"] = FLAGS.cross_entropy_impl
    model = dict(max_position_embeddings=max(base.model.max_position_embeddings, seq))
    if FLAGS.num_layers is not None:
        model["num_layers"] = FLAGS.num_layers
    return base.replace(model=model, execution=execution, precision=dict(compute_dtype="bfloat16"),
                        parallel=dict(cp=cp, fsdp=fsdp, cp_comm_type=FLAGS.cp_comm_type),
                        train=dict(seq_length=seq, micro_batch_size=1, global_batch_size=fsdp))


def saved_per_token(model, policy: str, save_names, itemsize: int) -> int:
    """Bytes one dense layer keeps per token for its backward under `policy` (the layer input is always kept: it is
    the scan's carry). `none`: every tensor the backward reads, approximately."""
    d, n, k, h, f = (model.hidden_size, model.num_attention_heads, model.num_query_groups, model.head_dim,
                     model.ffn_hidden_size)
    up = 2 * f if model.activation == "swiglu" else f
    lse = 4 * n  # the attention kernel's fp32 log-sum-exp per query
    named = {"norm": 2 * d * itemsize, "qkv_proj": (n + 2 * k) * h * itemsize, "attn_core": n * h * itemsize + lse,
             "attn_context": n * h * itemsize, "attn_out": d * itemsize, "mlp_up": up * itemsize,
             "mlp_hidden": f * itemsize, "mlp_out": d * itemsize}
    layer_input = d * itemsize
    if policy == "full":
        return layer_input
    if policy == "selective":
        unknown = [name for name in save_names if name not in named]
        if unknown:
            raise BadInput(f"no per-token size for the remat names {unknown} (dense layers only): change the "
                           f"config's remat_save_names or use --remat_policy=full")
        return layer_input + sum(named[name] for name in save_names)
    # none: x, both norms' outputs, q/k/v after RoPE, the attention output and lse, the mid-layer residual, the
    # up projection, the activation's output
    return (layer_input + named["norm"] + named["qkv_proj"] + named["attn_core"] + layer_input
            + named["mlp_up"] + named["mlp_hidden"])


def activation_estimate(cfg, seq: int, cp: int) -> dict:
    """Analytic activation bytes per device (the module docstring's formula), by term."""
    m, e = cfg.model, cfg.execution
    if m.num_experts:
        raise BadInput(f"--config={FLAGS.config}: the activation estimate covers dense models only")
    tokens = cfg.train.micro_batch_size * seq // cp
    itemsize = jnp.dtype(cfg.precision.compute_dtype).itemsize
    saved = saved_per_token(m, e.remat_policy, e.remat_save_names, itemsize)
    recomputed = 0 if e.remat_policy == "none" else saved_per_token(m, "none", (), itemsize)
    if e.cross_entropy_impl == "reference":  # the fp32 logits the backward reads, and their gradient
        loss = {"logits_bytes": tokens * 2 * 4 * m.padded_vocab_size()}
    else:  # fused: the gradient of h, saved by the forward, and one chunk's fp32 logits and their gradient
        loss = {"logits_bytes": min(e.cross_entropy_chunk, tokens) * 2 * 4 * m.padded_vocab_size(),
                "output_grad_bytes": tokens * m.hidden_size * itemsize}
    terms = {"layers_bytes": tokens * saved * m.num_layers, "recomputed_layer_bytes": tokens * recomputed, **loss}
    return terms | {"total_bytes": sum(terms.values())}


def compile_case(cfg, num_devices: int) -> dict:
    """XLA's memory analysis of one compiled train step (bytes per device), or the reason it did not compile."""
    setup = build(cfg, jax.devices()[:num_devices])
    shape = (setup.micro_batches, cfg.train.global_batch_size // setup.micro_batches, cfg.train.seq_length)
    batch = {k: jax.ShapeDtypeStruct(shape, jnp.float32 if k == "loss_mask" else jnp.int32,
                                     sharding=setup.batch_sharding)
             for k in ("inputs", "targets", "loss_mask", "positions")}  # what place_batch gives with --cp > 1
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), setup.abstract_state,
                         setup.state_sharding)
    t0 = time.perf_counter()
    try:
        compiled, seconds = setup.compile_step(state, batch, FAST_COMPILE)
    except Exception as e:  # noqa: BLE001  (any compile failure is this cell's result; the grid goes on)
        return {"error": failure_reason(e), "error_detail": str(e)[:4000], "compile_s": time.perf_counter() - t0}
    analysis = compiled_memory(compiled)
    if analysis is None:
        raise BadInput(f"the {jax.default_backend()} backend gives no memory analysis of a compiled step")
    m, total = analysis
    return {"argument_bytes": m.argument_size_in_bytes, "output_bytes": m.output_size_in_bytes,
            "alias_bytes": m.alias_size_in_bytes, "temp_bytes": m.temp_size_in_bytes, "total_bytes": total,
            "compile_s": seconds, "error": None}


def failure_reason(e: Exception) -> str:
    """One short line: the exception's first line, the innermost `XxxError` line when it wraps a traceback, and the
    Python line XLA names as the suspect."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    first = re.sub(r"\s*Traceback \(most recent call last\):$", "", lines[0] if lines else "")
    parts = [f"{type(e).__name__}: {first}"]
    inner = [line for line in lines[1:] if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", line)]
    if inner:
        parts.append(inner[-1])
    if "Suspected Python Code Location:" in lines[:-1]:
        where = lines[lines.index("Suspected Python Code Location:") + 1]
        parts.append("at " + re.sub(r"^.*/(mjax/\S+?):(\d+):\d+.*$", r"\1:\2", where))
    return " ".join(parts)[:200]


def cell(case: dict, unit: str, notes: list | None = None) -> str:
    """temp / total [estimate]; a failure as a numbered note (`notes` collects them) or, without notes, inline."""
    if case["error"]:
        if notes is None:
            return f"failed: {case['error']}"
        if case["error"] not in notes:
            notes.append(case["error"])
        return f"failed ({notes.index(case['error']) + 1})"
    return " / ".join(f"{case[k] / UNITS[unit]:.2f}" for k in ("temp_bytes", "total_bytes")) + \
        f" [{case['estimate']['total_bytes'] / UNITS[unit]:.2f}]"


def table_unit(cases) -> str:
    largest = max([c["total_bytes"] for c in cases if not c["error"]], default=0)
    return "GiB" if largest >= UNITS["GiB"] else "MiB"


def table(cfg, seqs, cps, num_devices, cases, states) -> str:
    m, e = cfg.model, cfg.execution
    unit = table_unit([*cases.values(), *states.values()])
    title = (f"Per-device {unit} of the compiled train step (XLA memory analysis; CPU compile, Pallas attention "
             f"interpreted): {FLAGS.config}, {m.num_layers} layers, {cfg.precision.compute_dtype}, "
             f"--remat_policy={e.remat_policy}, --cross_entropy_impl={e.cross_entropy_impl}, "
             f"--cp_comm_type={FLAGS.cp_comm_type}, {num_devices} devices = cp x fsdp, micro batch 1. "
             f"Cells: temporaries / total [analytic activations].")
    rows = ["| seq | " + " | ".join(f"cp={cp} (fsdp {num_devices // cp})" for cp in cps) + " |",
            "|---|" + "---|" * len(cps)]

    notes = []

    def state_cell(cp, key):
        case = states[cp]
        return cell(case, unit, notes) if case["error"] else f"{case[key] / UNITS[unit]:.2f}"

    rows.append("| arguments | " + " | ".join(state_cell(cp, "argument_bytes") for cp in cps) + " |")
    rows.append(f"| temp at {STATE_TOKENS} tokens/device | "
                + " | ".join(state_cell(cp, "temp_bytes") for cp in cps) + " |")
    for seq in seqs:
        rows.append(f"| {length_label(seq)} | " + " | ".join(cell(cases[seq, cp], unit, notes) for cp in cps) + " |")
    failures = [f"({i}) {reason.replace('|', '/')}" for i, reason in enumerate(notes, 1)]
    return "\n".join([title, "", *rows] + (["", *failures] if failures else []))


def main():
    seqs = [parse_length(s) for s in FLAGS.seqs]
    try:
        cps = [int(c) for c in FLAGS.cps]
    except ValueError:
        raise BadInput(f"--cps={','.join(FLAGS.cps)}: expected comma-separated integers") from None
    available = jax.device_count()
    num_devices = available if FLAGS.num_devices is None else FLAGS.num_devices
    if not 1 <= num_devices <= available:
        raise BadInput(f"--num_devices={num_devices}: {available} JAX devices here (on CPU set "
                       f"JAX_NUM_CPU_DEVICES)")
    bad = [cp for cp in cps if cp < 1 or num_devices % cp]
    if bad:
        raise BadInput(f"--cps: {bad} do not divide --num_devices={num_devices} (the layout is cp x fsdp)")
    base = load_config(FLAGS.config)
    configs = {(seq, cp): case_config(base, seq, cp, num_devices) for seq in seqs for cp in cps}
    state_configs = {cp: case_config(base, STATE_TOKENS * cp, cp, num_devices) for cp in cps}
    for cfg in [*configs.values(), *state_configs.values()]:  # every config error before the first compile
        build(cfg, jax.devices()[:num_devices])
    estimates = {key: activation_estimate(cfg, *key) for key, cfg in configs.items()}

    t0 = time.perf_counter()
    states, cases = {}, {}
    for cp in cps:
        states[cp] = compile_case(state_configs[cp], num_devices)
        print(f"cp={cp}: {STATE_TOKENS} tokens/device compiled in {states[cp]['compile_s']:.1f} s", flush=True)
    for (seq, cp), cfg in configs.items():
        cases[seq, cp] = compile_case(cfg, num_devices) | {"estimate": estimates[seq, cp]}
        unit = table_unit([cases[seq, cp]])
        print(f"seq {length_label(seq)} cp={cp}: {cell(cases[seq, cp], unit)} {unit} (compiled in "
              f"{cases[seq, cp]['compile_s']:.1f} s)", flush=True)
    elapsed = time.perf_counter() - t0
    cfg = next(iter(configs.values()))
    print()
    print(table(cfg, seqs, cps, num_devices, cases, states))
    print(f"\n{len(cases) + len(states)} compiles in {elapsed:.0f} s")
    if FLAGS.json_out:
        report = {"config": FLAGS.config, "num_layers": cfg.model.num_layers, "num_devices": num_devices,
                  "remat_policy": cfg.execution.remat_policy, "cross_entropy_impl": cfg.execution.cross_entropy_impl,
                  "cp_comm_type": FLAGS.cp_comm_type, "backend": jax.default_backend(), "jax": jax.__version__,
                  "compile_seconds": elapsed,
                  "state_only": [{"cp": cp, "tokens_per_device": STATE_TOKENS, **states[cp]} for cp in cps],
                  "cases": [{"seq": seq, "cp": cp, "fsdp": num_devices // cp, **c} for (seq, cp), c in cases.items()]}
        with open(FLAGS.json_out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    run_main(main)
