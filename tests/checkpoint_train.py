"""`scripts/train.py`, except that the save of step $MJAX_TEST_HANG_STEP never completes: once its data is written
(before Orbax's commit rename) this prints HANGING_SAVE and blocks, so a test can kill -9 the run mid-save."""

import os
import runpy
import sys
import time
from pathlib import Path

from orbax.checkpoint._src.path import atomicity

_finalize = atomicity.AtomicRenameTemporaryPath.finalize


async def _hanging_finalize(self):
    if self._final_path.name == os.environ["MJAX_TEST_HANG_STEP"]:
        print("HANGING_SAVE", flush=True)
        time.sleep(3600)
    return await _finalize(self)


atomicity.AtomicRenameTemporaryPath.finalize = _hanging_finalize
script = Path(__file__).resolve().parent.parent / "scripts" / "train.py"
sys.argv = [str(script), *sys.argv[1:]]
runpy.run_path(str(script), run_name="__main__")
