"""Where metrics go: a console line, JSON lines (--metrics_file), TensorBoard events and a progress bar.

Only process 0 writes the metrics file, TensorBoard and the progress bar (its console lines come from the logging
setup, which keeps other processes to warnings and errors), so N processes do not write every step N times."""

import json
import logging
import math
import re
import sys
import time
from pathlib import Path

import jax

from mjax import logging_setup

log = logging.getLogger("mjax")

CONSOLE_FIELDS = (("loss", "{:.4f}"), ("grad_norm", "{:.3f}"), ("lr", "{:.3e}"), ("step_time_s", "{:.3f}s"),
                  ("tokens_per_s", "{:,.0f}"), ("tflops_per_device", "{:.3g}"), ("mfu", "{:.1%}"),
                  ("peak_memory_bytes", "{}"), ("moe_aux_loss", "{:.4g}"), ("moe_z_loss", "{:.4g}"),
                  ("moe_load_max", "{:.2f}"), ("moe_load_min", "{:.2f}"), ("moe_dropped_fraction", "{:.2%}"),
                  ("attention_imbalance", "{:.3f}"))


def _depth(key: str) -> int:
    """k for a multi-token prediction loss "mtp_k_loss", else 0."""
    match = re.fullmatch(r"mtp_(\d+)_loss", key)
    return int(match.group(1)) if match else 0


def _format(key: str, fmt: str, value) -> str:
    if key == "peak_memory_bytes":
        return f"mem {value / 2**30:.2f} GiB"
    return f"{key} {fmt.format(value)}"


class TensorBoard:
    def __init__(self, logdir: str):
        from tensorboard.compat.proto.event_pb2 import Event  # noqa: PLC0415
        from tensorboard.compat.proto.summary_pb2 import Summary  # noqa: PLC0415
        from tensorboard.summary.writer.event_file_writer import EventFileWriter  # noqa: PLC0415

        self._event, self._summary = Event, Summary
        self._writer = EventFileWriter(logdir)

    def write(self, step: int, scalars: dict):
        values = [self._summary.Value(tag=k, simple_value=float(v)) for k, v in scalars.items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
        self._writer.add_event(self._event(summary=self._summary(value=values), step=step, wall_time=time.time()))
        self._writer.flush()

    def close(self):
        self._writer.close()


class Progress:
    """One rewritten line at the bottom of a terminal; silent when stderr is not a terminal. While it is shown, the
    console log handler (mjax.logging_setup) clears it before each log line and redraws it after, so no line is
    overwritten."""

    def __init__(self, total: int, start: int, enabled: bool):
        self.total, self.start, self.t0 = total, start, time.perf_counter()
        self.enabled = enabled and sys.stderr.isatty()
        self.line = ""
        if self.enabled:
            logging_setup.set_status_line(self)

    def update(self, step: int):
        if not self.enabled:
            return
        done = (step - self.start) / max(self.total - self.start, 1)
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / done * (1 - done) if done > 0 else 0.0
        bar = "#" * int(30 * done) + "." * (30 - int(30 * done))
        self.line = f"[{bar}] {step}/{self.total} eta {eta:6.0f}s"
        self.draw()

    def draw(self):
        sys.stderr.write("\r\033[2K" + self.line)
        sys.stderr.flush()

    def clear(self):
        sys.stderr.write("\r\033[2K")
        sys.stderr.flush()

    def close(self):
        if self.enabled:
            logging_setup.set_status_line(None)
            self.clear()


class MetricsLogger:
    def __init__(self, cfg, start_step: int, writer: bool | None = None):
        """`writer`: whether this process writes the file, TensorBoard and bar (default: process 0 only)."""
        lc = cfg.logging
        writer = jax.process_index() == 0 if writer is None else writer
        self.metrics_file = None
        if lc.metrics_file and writer:
            Path(lc.metrics_file).parent.mkdir(parents=True, exist_ok=True)
            self.metrics_file = open(lc.metrics_file, "a")  # noqa: SIM115  (closed in close())
        self.tensorboard = TensorBoard(lc.tensorboard_dir) if lc.tensorboard_dir and writer else None
        self.progress = Progress(cfg.train.train_iters, start_step, lc.progress and writer)

    def log(self, record: dict):
        parts = [f"step {record['step']:>6}"]
        for key, fmt in CONSOLE_FIELDS:
            value = record.get(key)
            if value is not None:
                parts.append(_format(key, fmt, value))
            if key == "loss":  # the multi-token prediction depths' losses (mtp_1_loss, ...) follow the model's
                parts += [f"{k} {record[k]:.4f}" for k in sorted(record, key=_depth) if _depth(k)]
        if record.get("skipped_steps"):
            parts.append(f"skipped {record['skipped_steps']}")
        log.info(" | ".join(parts))
        self._write(record, record)

    def log_eval(self, record: dict):
        """An evaluation result {"step", "split", "eval_loss", "eval_ppl"} (split: valid, valid/<dataset>, test)."""
        log.info("step %6d | %s loss %.4f | %s ppl %.2f", record["step"], record["split"], record["eval_loss"],
                 record["split"], record["eval_ppl"])
        self._write(record, {f"{record['split']}/lm_loss": record["eval_loss"],
                             f"{record['split']}/lm_ppl": record["eval_ppl"]})

    def _write(self, record: dict, scalars: dict):
        if self.metrics_file:
            self.metrics_file.write(json.dumps(record) + "\n")
            self.metrics_file.flush()
        if self.tensorboard:
            self.tensorboard.write(record["step"], scalars)

    def close(self):
        self.progress.close()
        if self.metrics_file:
            self.metrics_file.close()
        if self.tensorboard:
            self.tensorboard.close()
