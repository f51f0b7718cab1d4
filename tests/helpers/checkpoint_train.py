"""`scripts/train.py` with two test hooks, so a test can kill or signal it at a known moment:

MJAX_TEST_HANG_STEP=K   the save of step K never completes: once its data is written (before Orbax's commit rename)
                        this prints HANGING_SAVE and blocks, for a kill -9 mid-save.
MJAX_TEST_PAUSE_STEP=K  after step K this prints PAUSED and waits for SIGTERM/SIGINT.
"""

import os
import runpy
import sys
import time
from pathlib import Path

from orbax.checkpoint._src.path import atomicity

from mjax.train.checkpoint import Checkpointer

_finalize = atomicity.AtomicRenameTemporaryPath.finalize
_after_step = Checkpointer.after_step


async def _hanging_finalize(self):
    if self._final_path.name == os.environ.get("MJAX_TEST_HANG_STEP"):
        print("HANGING_SAVE", flush=True)
        time.sleep(3600)
    return await _finalize(self)


def _pausing_after_step(self, step, state, consumed):
    if str(step) == os.environ.get("MJAX_TEST_PAUSE_STEP"):
        print("PAUSED", flush=True)
        while self._signals.signum is None:
            time.sleep(0.05)
    return _after_step(self, step, state, consumed)


atomicity.AtomicRenameTemporaryPath.finalize = _hanging_finalize
Checkpointer.after_step = _pausing_after_step
script = Path(__file__).resolve().parents[2] / "scripts" / "train.py"
sys.argv = [str(script), *sys.argv[1:]]
runpy.run_path(str(script), run_name="__main__")
