"""Peak resident memory of a phase of this process (Linux), as an increment over its start.

Before a phase: return freed heap to the OS (malloc_trim) and reset the kernel's peak-RSS
mark (writing 5 to /proc/self/clear_refs); after it: VmHWM minus the RSS at the start.
So contenders run one after another in the same process are measured separately.
"""

from __future__ import annotations

import ctypes
import gc


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class PeakMemory:
    def __enter__(self):
        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:  # not glibc: peaks then include memory kept by earlier phases
            pass
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.start_kib = _status_kib("VmRSS")
        return self

    def __exit__(self, *exc):
        self.peak_mib = max(0, _status_kib("VmHWM") - self.start_kib) / 1024.0
        return False
