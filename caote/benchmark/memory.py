"""What the memory holds: the process's resident memory (now and at its peak), the model's weight bytes, a cache's
KV bytes; and the machine's load average (the numbers are only as quiet as the machine)."""

from __future__ import annotations

import ctypes
import os
import resource
import sys

from caote.cache import EvictionCache


def _proc_status_bytes(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def peak_rss_bytes() -> int:
    """The process's resident-memory high-water mark (``VmHWM``; ``ru_maxrss`` where /proc is missing)."""
    value = _proc_status_bytes("VmHWM")
    if value is None:
        scale = 1 if sys.platform == "darwin" else 1024
        value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    return value


def rss_bytes() -> int:
    """The process's resident memory now (``VmRSS``; 0 where /proc is missing)."""
    return _proc_status_bytes("VmRSS") or 0


def reset_peak_rss() -> bool:
    """Hand freed heap memory back to the kernel (``malloc_trim``) and reset ``VmHWM`` to the current resident size
    (``/proc/self/clear_refs``, Linux >= 4.0), so that the next `peak_rss_bytes` is the peak of what follows.
    False where either is unavailable (then the high-water mark also carries earlier peaks)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except (OSError, AttributeError):
        return False


def load_average() -> list[float]:
    try:
        return [round(value, 2) for value in os.getloadavg()]
    except OSError:
        return []


def weight_bytes(model) -> int:
    """Bytes of the model's parameters, each tied tensor counted once (what one decoded token must read)."""
    seen, total = set(), 0
    for parameter in model.parameters():
        if parameter.data_ptr() in seen:
            continue
        seen.add(parameter.data_ptr())
        total += parameter.numel() * parameter.element_size()
    return total


def cache_bytes(cache) -> int:
    """Keys + values held by any transformers cache right now."""
    if isinstance(cache, EvictionCache):
        return cache.kv_bytes()
    total = 0
    for layer in cache.layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if tensor is not None and tensor.dim() > 1:
                total += tensor.numel() * tensor.element_size()
    return total
