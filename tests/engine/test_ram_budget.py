"""The KV cache's default RAM budget: what the memory tiers may take together when no budget is set, the bound
that chose it (shown by /health, `kvboost cache stats` and the app's meter), and how the tiers share it."""

from __future__ import annotations

import pytest

from engine.ram_budget import RamBudget, default_ram_budget

GiB = 1 << 30


def test_a_roomy_desktop_gives_the_cache_a_tenth_of_its_ram():
    # the machine of issue 64: 23.4 GiB, most of it free; the old default took 6.9 GB of it
    budget = default_ram_budget(int(23.4 * GiB), 18 * GiB)
    assert budget == RamBudget(int(23.4 * GiB) // 10, "10% of 23.4 GiB RAM")


def test_a_busy_machine_gives_at_most_a_quarter_of_what_is_available_at_start():
    budget = default_ram_budget(16 * GiB, 3 * GiB)
    assert budget == RamBudget(768 << 20, "25% of the 3.0 GiB available at start")


def test_a_large_machine_stops_at_four_gib():
    budget = default_ram_budget(128 * GiB, 100 * GiB)
    assert budget == RamBudget(4 * GiB, "the 4 GiB cap (10% of 128.0 GiB RAM would be more)")


def test_the_memory_tiers_share_the_budget_without_exceeding_it():
    import torch

    from engine.kv.tiers import default_device_budget, default_host_budget

    ram = default_ram_budget(int(23.4 * GiB), 18 * GiB)
    cpu = torch.device("cpu")
    device, host = default_device_budget(cpu, ram), default_host_budget(cpu, ram)
    # on a CPU-only machine both tiers are RAM: together they stay within the budget
    assert device[0] + host[0] == ram.bytes
    assert device[0] == ram.bytes * 2 // 3
    assert device[1] == "default: 2/3 of 2.3 GiB (10% of 23.4 GiB RAM)"
    assert host[1] == "default: 1/3 of 2.3 GiB (10% of 23.4 GiB RAM)"
    # under a GPU the host tier is the only RAM tier: it takes the whole budget
    assert default_host_budget(torch.device("cuda"), ram) == (ram.bytes, "default: 10% of 23.4 GiB RAM")


@pytest.mark.parametrize("total, available", [(0, 0), (-1, 4 * GiB)])
def test_a_machine_that_reports_no_ram_is_misuse(total, available):
    with pytest.raises(ValueError, match="total"):
        default_ram_budget(total, available)
