"""Where metrics go: a console line, JSON lines (--metrics_file), TensorBoard events and a progress bar."""

import json
import logging
import math
import sys
import time
from pathlib import Path

log = logging.getLogger("mjax")

CONSOLE_FIELDS = (("loss", "{:.4f}"), ("grad_norm", "{:.3f}"), ("lr", "{:.3e}"), ("step_time_s", "{:.3f}s"),
                  ("tokens_per_s", "{:,.0f}"), ("tflops_per_device", "{:.1f}"), ("mfu", "{:.1%}"))


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
    """One rewritten line on a terminal; silent when stderr is not a terminal."""

    def __init__(self, total: int, start: int, enabled: bool):
        self.total, self.start, self.t0 = total, start, time.perf_counter()
        self.enabled = enabled and sys.stderr.isatty()

    def update(self, step: int, loss: float | None = None):
        if not self.enabled:
            return
        done = (step - self.start) / max(self.total - self.start, 1)
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / done * (1 - done) if done > 0 else 0.0
        bar = "#" * int(30 * done) + "." * (30 - int(30 * done))
        loss_txt = "" if loss is None else f" loss {loss:.4f}"
        sys.stderr.write(f"\r[{bar}] {step}/{self.total}{loss_txt} eta {eta:6.0f}s")
        sys.stderr.flush()

    def close(self):
        if self.enabled:
            sys.stderr.write("\n")


class MetricsLogger:
    def __init__(self, cfg, start_step: int):
        lc = cfg.logging
        self.metrics_file = None
        if lc.metrics_file:
            Path(lc.metrics_file).parent.mkdir(parents=True, exist_ok=True)
            self.metrics_file = open(lc.metrics_file, "a")  # noqa: SIM115  (closed in close())
        self.tensorboard = TensorBoard(lc.tensorboard_dir) if lc.tensorboard_dir else None
        self.progress = Progress(cfg.train.train_iters, start_step, lc.progress)

    def log(self, record: dict):
        parts = [f"step {record['step']:>6}"]
        for key, fmt in CONSOLE_FIELDS:
            value = record.get(key)
            if value is not None:
                parts.append(f"{key} {fmt.format(value)}")
        if record.get("skipped_steps"):
            parts.append(f"skipped {record['skipped_steps']}")
        if self.progress.enabled:
            sys.stderr.write("\r")
        log.info(" | ".join(parts))
        if self.metrics_file:
            self.metrics_file.write(json.dumps(record) + "\n")
            self.metrics_file.flush()
        if self.tensorboard:
            self.tensorboard.write(record["step"], record)

    def close(self):
        self.progress.close()
        if self.metrics_file:
            self.metrics_file.close()
        if self.tensorboard:
            self.tensorboard.close()
