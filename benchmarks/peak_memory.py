"""Peak extra memory of a block of code, for the benchmarks (each variant runs in a fresh process).

CPU: VmHWM (the resident high-water mark), reset to the current RSS at `start()` through
/proc/self/clear_refs; where that is not possible, ru_maxrss (a lifetime peak, valid only
when nothing before `start()` used more). CUDA: torch.cuda.max_memory_allocated.
"""
from __future__ import annotations

import gc
import resource


def status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(key)


class PeakMemory:
    """Peak extra memory (MiB) since `start()`, by the most reliable method available."""

    def __init__(self, device: str = "cpu"):
        import torch

        self.torch, self.cuda = torch, device.startswith("cuda")
        self.method = "cuda.max_memory_allocated" if self.cuda else "VmHWM"

    def start(self) -> None:
        gc.collect()
        if self.cuda:
            self.torch.cuda.synchronize()
            self.torch.cuda.reset_peak_memory_stats()
            self.base = self.torch.cuda.memory_allocated() / 2**20
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            self.base = status_mib("VmRSS")
        except OSError:
            # No reset possible: ru_maxrss is a lifetime peak, so this is only valid if
            # nothing before this point used more memory than the inputs do now.
            self.method = "ru_maxrss"
            self.base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def peak(self) -> float:
        if self.cuda:
            self.torch.cuda.synchronize()
            return self.torch.cuda.max_memory_allocated() / 2**20 - self.base
        if self.method == "VmHWM":
            return status_mib("VmHWM") - self.base
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - self.base
