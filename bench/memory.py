"""Peak memory of a phase of this process, as an increment over its start: on the CPU the resident set
(Linux), on a CUDA device the caching allocator's tensors (host RSS does not see GPU memory).

Before a phase: return freed heap to the OS (malloc_trim) and reset the kernel's peak-RSS
mark (writing 5 to /proc/self/clear_refs); after it: VmHWM minus the RSS at the start.
With ``PeakMemory(device="cuda:0")``: ``torch.cuda.reset_peak_memory_stats`` before, and
``max_memory_allocated`` minus the allocated bytes at the start after (``reserved_mib``: the allocator's
reserved peak, slack included); ``host_mib`` keeps the RSS figure either way.
So contenders run one after another in the same process are measured separately.
"""

from __future__ import annotations

import ctypes
import gc


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak() -> int:
    """Free heap returned to the OS, then the kernel's peak-RSS mark reset; returns the RSS (KiB) after."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: peaks then include memory kept by earlier phases
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_kib("VmRSS")


class PeakMemory:
    def __init__(self, device=None):
        import torch

        self.device = torch.device(device) if device is not None else None
        self.cuda = self.device is not None and self.device.type == "cuda"

    def __enter__(self):
        self.start_kib = reset_peak()
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start_bytes = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc):
        self.host_mib = max(0, status_kib("VmHWM") - self.start_kib) / 1024.0
        self.peak_mib = self.host_mib
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)
            self.peak_mib = max(0, torch.cuda.max_memory_allocated(self.device) - self.start_bytes) / 2**20
            self.reserved_mib = torch.cuda.max_memory_reserved(self.device) / 2**20
        return False
