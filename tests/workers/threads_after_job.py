"""The training job, then the gloo threads still alive in this process once it has returned.

    torchrun --nproc_per_node 2 tests/workers/threads_after_job.py OUT_DIR [job flags]

Runs `co2_zero.train.main` with the job flags and writes `OUT_DIR/rank<R>.json`: the names of this
process's native threads that belong to a gloo process group (its run loops and transport loops). A
group alive after the job lives until interpreter shutdown, where its threads can abort the process
(docs/design.md §8); tests/tools/test_train_lm_smoke.py expects none.
"""

import json
import os
import sys
from pathlib import Path

from co2_zero.train import main

GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")


def live_threads() -> list[str]:
    names = []
    for task in Path("/proc/self/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return names


if __name__ == "__main__":
    out_dir, flags = Path(sys.argv[1]), sys.argv[2:]
    main(flags)
    gloo = [name for name in live_threads() if name in GLOO_THREADS]
    (out_dir / f"rank{os.environ['RANK']}.json").write_text(json.dumps(gloo))
