"""What touching memory costs on this machine: CPU-seconds (user, kernel) per GB, 1 GB at a time.

On the virtual machines `make test` runs on, free memory is handed back to the host (virtio-balloon free page
reporting), and the first touch of a page the host took back costs a host fault and its zeroing: about
10 CPU-seconds a GB, shown as kernel time, where memory the process or another one freed a moment ago costs ~0.35.
Big tensors freed and allocated again (a 262k-vocabulary model's logits), every model load and every process's
start pay it, so the suite's kernel time grows with the memory it touches afresh (bench/results/notes.md,
"make test's CPU").

    .venv/bin/python bench/perf/fresh_memory.py [GB]      # allocate GB one at a time, free, wait, again
"""

from __future__ import annotations

import resource
import sys
import time

import torch


def touch_one_gb() -> tuple[torch.Tensor, float, float]:
    before = resource.getrusage(resource.RUSAGE_SELF)
    x = torch.ones(256 * 1024 * 1024)  # fp32: 1 GiB, every page written
    after = resource.getrusage(resource.RUSAGE_SELF)
    return x, after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime


def main(gb: int = 6) -> None:
    torch.set_num_threads(1)
    for round_name in ("first", "again, 3 s after freeing"):
        held = []
        for i in range(gb):
            x, user, kernel = touch_one_gb()
            held.append(x)
            print(f"{round_name:26s} GB {i + 1}: user {user:5.2f} s, kernel {kernel:5.2f} s", flush=True)
        del held, x
        time.sleep(3)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 6)
