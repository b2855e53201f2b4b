"""Host memory near a GPU: the NUMA node a CUDA device hangs off, and binding host pages to it.

On a host with several NUMA nodes (one per CPU socket), a GPU reaches its own node's DRAM over its
PCIe root and every other node's across the link between the sockets, which is slower and shared.
The DRAM pool is what the GPU reads misses from and saves blocks to, so a pool pinned for a device
is placed on that device's node: the range's memory policy is set (`mbind`, "preferred": the
kernel falls back to other nodes rather than fail when the node is full) before its pages are
first touched. Where the host has one node, the node is unknown or the call is refused, nothing is
bound and the memory is placed as it would have been.

Linux only (sysfs and the `mbind` / `get_mempolicy` system calls on x86_64 and aarch64).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
SYSFS = Path("/sys")
MPOL_PREFERRED = 1  # <linux/mempolicy.h>: place pages on the node, else anywhere
MPOL_F_ADDR = 2  # get_mempolicy: the policy of the range at `addr`, not the thread's
MASK_WORD_BITS = 64
MASK_WORDS = 16  # node masks of 1,024 nodes: more than Linux's largest configuration
SYSCALLS = {  # name -> number, per machine
    "x86_64": {"mbind": 237, "get_mempolicy": 239},
    "aarch64": {"mbind": 235, "get_mempolicy": 236},
}


def parse_node_list(text: str) -> list[int]:
    """Node (or CPU) ids of a sysfs list such as "0-1,4" -> [0, 1, 4]; "" -> []."""
    ids: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        ids += range(int(first), int(last or first) + 1)
    return ids


def host_nodes(sysfs: Path = SYSFS) -> list[int]:
    """The host's online NUMA nodes ([] where sysfs does not say)."""
    try:
        return parse_node_list((sysfs / "devices/system/node/online").read_text())
    except (OSError, ValueError):
        return []


def pci_node(address: str, sysfs: Path = SYSFS) -> int | None:
    """The NUMA node of the PCI device at `address` ("0000:3b:00.0"), or None where sysfs does not
    know it (-1: the firmware gives no locality, as on one-node hosts)."""
    try:
        node = int((sysfs / "bus/pci/devices" / address.lower() / "numa_node").read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def pci_address(device: torch.device) -> str | None:
    """The PCI address ("0000:3b:00.0") of a CUDA device, or None where PyTorch does not report it."""
    properties = torch.cuda.get_device_properties(device)
    parts = [getattr(properties, f"pci_{name}_id", None) for name in ("domain", "bus", "device")]
    if None in parts:
        return None
    domain, bus, slot = parts
    return f"{domain:04x}:{bus:02x}:{slot:02x}.0"


def device_node(device: torch.device | str, sysfs: Path = SYSFS) -> int | None:
    """The NUMA node whose DRAM is nearest `device`: its PCI node on a CUDA device of a host with
    several nodes; None on a one-node host, for a CPU device, or where the node is unknown."""
    device = torch.device(device)
    if device.type != "cuda" or len(host_nodes(sysfs)) < 2:
        return None
    address = pci_address(device)
    return None if address is None else pci_node(address, sysfs)


def bind_to_node(address: int, nbytes: int, node: int) -> bool:
    """Prefer `node` for the pages of [address, address + nbytes) (page-aligned) not yet touched.

    Returns whether the kernel took it; a refusal (an unknown machine, a node that does not exist,
    a kernel without NUMA) is logged and changes nothing.
    """
    if platform.machine() not in SYSCALLS or not 0 <= node < MASK_WORDS * MASK_WORD_BITS:
        logger.info("NUMA: not binding host memory to node %s on %s", node, platform.machine())
        return False
    mask = (ctypes.c_ulong * MASK_WORDS)()
    mask[node // MASK_WORD_BITS] = 1 << (node % MASK_WORD_BITS)
    result = _syscall(
        "mbind", ctypes.c_void_p(address), ctypes.c_ulong(nbytes), ctypes.c_int(MPOL_PREFERRED), mask,
        ctypes.c_ulong(MASK_WORDS * MASK_WORD_BITS + 1), ctypes.c_uint(0),
    )  # fmt: skip
    if result != 0:
        logger.info("NUMA: mbind to node %d refused: %s", node, os.strerror(ctypes.get_errno()))
        return False
    return True


def preferred_node(address: int) -> int | None:
    """The node the memory policy of the page at `address` prefers, or None (no such policy, or
    the call is unavailable): what `bind_to_node` set, as the kernel reports it."""
    mode, mask = ctypes.c_int(-1), (ctypes.c_ulong * MASK_WORDS)()
    result = _syscall(
        "get_mempolicy", ctypes.byref(mode), mask, ctypes.c_ulong(MASK_WORDS * MASK_WORD_BITS),
        ctypes.c_void_p(address), ctypes.c_ulong(MPOL_F_ADDR),
    )  # fmt: skip
    if result != 0 or mode.value != MPOL_PREFERRED:
        return None
    nodes = [w * MASK_WORD_BITS + b for w in range(MASK_WORDS) for b in range(MASK_WORD_BITS) if mask[w] >> b & 1]
    return nodes[0] if len(nodes) == 1 else None


def _syscall(name: str, *args) -> int | None:
    """The system call `name` of this machine (`SYSCALLS`) with ctypes `args`: its result (errno set
    where it fails), or None on a machine whose number is not known."""
    number = SYSCALLS.get(platform.machine(), {}).get(name)
    return None if number is None else _libc().syscall(ctypes.c_long(number), *args)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)
