"""NUMA placement of pinned host memory: the node a device hangs off (sysfs), and binding pages to it.

The binding is checked for real: the kernel's own report (`get_mempolicy`) of the policy set on a
pinned pool's pages. The topology is read from a sysfs tree built in a temporary folder where the
host cannot show it (this one has a single node and no GPU).
"""

from __future__ import annotations

import platform

import pytest
import torch

from sparseserve_hf import numa, pinned
from sparseserve_hf.cache.block_pool import BlockPool
from sparseserve_hf.pinned import pinned_empty

needs_linux_numa = pytest.mark.skipif(
    platform.machine() not in numa.SYSCALLS or 0 not in numa.host_nodes(),
    reason="mbind/get_mempolicy need Linux on x86_64 or aarch64 with NUMA node 0",
)


class Registrar:
    """Stands in for cudaHostRegister (no GPU here): records the locked ranges."""

    def __init__(self) -> None:
        self.locked: dict[int, int] = {}

    def register(self, address: int, nbytes: int) -> None:
        self.locked[address] = nbytes

    def unregister(self, address: int) -> None:
        del self.locked[address]


def fake_sysfs(root, online: str, devices: dict[str, str]):
    """A sysfs tree with `online` nodes and PCI devices {address: numa_node text}."""
    (root / "devices/system/node").mkdir(parents=True)
    (root / "devices/system/node/online").write_text(online + "\n")
    for address, node in devices.items():
        (root / "bus/pci/devices" / address).mkdir(parents=True)
        (root / "bus/pci/devices" / address / "numa_node").write_text(node + "\n")
    return root


@pytest.mark.core
def test_sysfs_lists_and_a_devices_node_are_read_as_linux_writes_them(tmp_path):
    assert numa.parse_node_list("0-1,4\n") == [0, 1, 4] and numa.parse_node_list("") == []
    assert numa.parse_node_list("0") == [0] and numa.parse_node_list("0-3") == [0, 1, 2, 3]
    sysfs = fake_sysfs(tmp_path, "0-1", {"0000:3b:00.0": "1", "0000:af:00.0": "-1"})
    assert numa.host_nodes(sysfs) == [0, 1]
    assert numa.pci_node("0000:3B:00.0", sysfs) == 1  # sysfs names are lower case
    assert numa.pci_node("0000:af:00.0", sysfs) is None  # -1: the firmware gives no locality
    assert numa.pci_node("0000:00:01.0", sysfs) is None  # no such device
    assert numa.host_nodes(tmp_path / "nowhere") == []


def test_a_cuda_device_maps_to_its_pci_node_only_on_a_host_with_several_nodes(tmp_path, monkeypatch):
    monkeypatch.setattr(numa, "pci_address", lambda device: "0000:3b:00.0")  # CUDA's report, without a GPU
    two = fake_sysfs(tmp_path / "two", "0-1", {"0000:3b:00.0": "1"})
    one = fake_sysfs(tmp_path / "one", "0", {"0000:3b:00.0": "0"})
    assert numa.device_node("cuda:0", two) == 1
    assert numa.device_node("cuda:0", one) is None  # one node: nothing to choose
    assert numa.device_node("cpu", two) is None and numa.device_node(torch.device("cpu")) is None
    monkeypatch.setattr(numa, "pci_address", lambda device: None)  # a PyTorch that does not report it
    assert numa.device_node("cuda:0", two) is None


@needs_linux_numa
@pytest.mark.core
def test_a_pinned_tensor_bound_to_a_node_has_that_policy_on_every_page_and_is_zeroed():
    registrar = Registrar()
    tensor = pinned_empty((64, 2, 32, 16), torch.float32, registrar, numa_node=0)  # 256 KiB: 64 pages
    first, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    assert registrar.locked == {first: nbytes}
    assert [numa.preferred_node(first + offset) for offset in (0, nbytes // 2, nbytes - pinned.PAGE_BYTES)] == [0] * 3
    assert not tensor.any()
    unbound = pinned_empty((64, 2, 32, 16), torch.float32, registrar)
    assert numa.preferred_node(unbound.data_ptr()) is None  # no node asked: the host's default policy
    del tensor  # a bound tensor's pages are a mapping of its own: unlocked (and unmapped) with it
    assert registrar.locked == {unbound.data_ptr(): nbytes}


@needs_linux_numa
def test_a_node_the_host_lacks_is_refused_and_the_memory_is_allocated_anyway(caplog):
    missing = 1023  # within the node mask, on no real host
    tensor = pinned_empty((8, 2, 32, 16), torch.float32, Registrar(), numa_node=missing)
    assert numa.preferred_node(tensor.data_ptr()) is None and not tensor.any()
    assert numa.bind_to_node(tensor.data_ptr(), pinned.PAGE_BYTES, missing) is False
    assert numa.bind_to_node(tensor.data_ptr(), pinned.PAGE_BYTES, -1) is False  # outside the mask: no call
    tensor.fill_(1.0)  # usable memory
    assert tensor.sum() == tensor.numel()


@needs_linux_numa
def test_a_pinned_dram_pool_puts_its_blocks_and_their_growth_on_its_node(monkeypatch):
    monkeypatch.setattr(pinned, "CudaRegistrar", Registrar)
    pool = BlockPool((2, 16, 8), torch.float32, None, pin=True, numa_node=0)  # growable: 256 blocks to start
    assert pool.numa_node == 0 and numa.preferred_node(pool.storage.data_ptr()) == 0
    ids = pool.allocate(pool.capacity + 1)  # past the first allocation: the pool grows into new memory
    assert ids is not None and numa.preferred_node(pool.storage.data_ptr()) == 0
    unpinned = BlockPool((2, 16, 8), torch.float32, 1 << 16, pin=False, numa_node=0)  # only pinned pools bind
    assert unpinned.numa_node is None


@pytest.mark.gpu
def test_a_cuda_devices_node_is_its_pci_node_or_none_on_one_node():
    address = numa.pci_address(torch.device("cuda:0"))
    assert address is None or len(address.split(":")) == 3
    expected = numa.pci_node(address) if address is not None and len(numa.host_nodes()) > 1 else None
    assert numa.device_node("cuda:0") == expected
