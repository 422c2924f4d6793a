"""The RAM this machine has and has free, and how much of it the KV cache's memory tiers take when no budget is set
(engine.kv.tiers splits it between them; the weights' fit reads what is free)."""

from __future__ import annotations

import os
from dataclasses import dataclass

# The RAM the KV cache's memory tiers may take together when no budget is set: a desktop runs the user's other
# programs too, so the cache takes a tenth of RAM, never more than a quarter of what was free when the engine
# started (a busy machine keeps its room), and at most 4 GiB (past that a bigger RAM tier saves little: the disk
# tier keeps what it evicts, and reading a chunk back from disk costs less than computing it again).
RAM_SHARE_OF_TOTAL = 0.10
RAM_SHARE_OF_AVAILABLE = 0.25
RAM_CAP_BYTES = 4 << 30


@dataclass(frozen=True)
class RamBudget:
    """What the memory tiers may take together by default, and the bound that chose it, in the user's words."""

    bytes: int
    rule: str  # "10% of 23.4 GiB RAM"


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 30):.1f} GiB"


def default_ram_budget(total_bytes: int, available_bytes: int) -> RamBudget:
    """The smallest of RAM_SHARE_OF_TOTAL of the machine's RAM, RAM_SHARE_OF_AVAILABLE of what is available now
    and RAM_CAP_BYTES, named by the bound that chose it."""
    if total_bytes <= 0 or available_bytes < 0:
        raise ValueError(f"RAM sizes must be positive, got total={total_bytes}, available={available_bytes}")
    of_total = int(total_bytes * RAM_SHARE_OF_TOTAL)
    of_available = int(available_bytes * RAM_SHARE_OF_AVAILABLE)
    if of_total <= min(of_available, RAM_CAP_BYTES):
        return RamBudget(of_total, f"{RAM_SHARE_OF_TOTAL:.0%} of {_gib(total_bytes)} RAM")
    if of_available <= RAM_CAP_BYTES:
        return RamBudget(of_available,
                         f"{RAM_SHARE_OF_AVAILABLE:.0%} of the {_gib(available_bytes)} available at start")
    return RamBudget(RAM_CAP_BYTES, f"the {RAM_CAP_BYTES >> 30} GiB cap ({RAM_SHARE_OF_TOTAL:.0%} of "
                                    f"{_gib(total_bytes)} RAM would be more)")


def machine_ram_budget() -> RamBudget:
    """default_ram_budget of this machine's RAM and what the OS says is available now (Linux: MemAvailable)."""
    return default_ram_budget(_total_ram_bytes(), available_ram_bytes())


def _total_ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: what psutil says, else a small machine
        try:
            import psutil
        except ImportError:
            return 8 << 30
        return psutil.virtual_memory().total


def available_ram_bytes() -> int:
    """The RAM the OS says is available now (Linux: MemAvailable), in bytes."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil
    except ImportError:
        return _total_ram_bytes() // 2
    return psutil.virtual_memory().available
