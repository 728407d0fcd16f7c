"""The `main()` every multi-rank test worker shares.

    python WORKER.py [ARGS ...] OUT.json    (under torchrun, deepspeed, accelerate launch, or alone)

Sets the CPU accelerator and one torch thread, prints native crashes' Python stacks, drops the
`--local_rank=N` the deepspeed launcher adds, calls `run(args, out_path)` on every rank, and writes what rank 0's
call returned to OUT.json; then all ranks meet at a barrier, leave the process group and exit at once.
"""

import faulthandler
import json
import os
import sys
from collections.abc import Callable

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def main(run: Callable[[list[str], str], dict]) -> None:
    faulthandler.enable()  # a native crash (abort, segfault) prints the Python stacks of every thread
    import torch
    import torch.distributed as dist

    from curvzo_ds.startup import exit_now

    torch.set_num_threads(1)
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    *args, out_path = args
    result = run(args, out_path)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f, default=str)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    # The result is written and every rank has met; the interpreter's teardown sometimes aborts in a library's
    # communication thread (seen under the deepspeed launcher with the HF Trainer and under torchrun).
    exit_now(0)
