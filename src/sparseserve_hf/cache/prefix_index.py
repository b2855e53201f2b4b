"""PrefixIndex: full KV blocks of earlier prompts, found again by the tokens before and in them.

Many requests share a long start (one document, many questions; a chat's history). A block's KV
depends only on its tokens and every token before it, so a block is addressed by that whole
prefix: a chain of entries, one per block position, each holding its own `block_size` tokens and
pointing at its parent. A lookup walks the chain comparing tokens, never trusting a hash alone
(the hash only picks a bucket), so two prefixes that collide are never confused.

An entry holds one store reference on its head-blocks (every sparse layer, every KV head), so
they outlive the request that computed them; the metadata lives with the blocks (indexed by
DRAM id) and is shared with them. `reclaim` gives blocks back, least recently used leaves
first, and never an entry that a live request adopted: a referenced block is never freed.
Pure bookkeeping on the host: it answers "no match" instead of raising.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class BlockRefs(Protocol):
    """The store's reference counting (`TieredBlockStore.retain`; `free` returns the blocks it released)."""

    def retain(self, ids: torch.Tensor) -> None:
        """One more reference to each block in `ids`."""
        ...

    def free(self, ids: torch.Tensor) -> int:
        """One reference less to each block in `ids`; returns the blocks that became free."""
        ...


@dataclass(eq=False)
class PrefixEntry:
    """One block position of a cached prefix.

    tokens: the block's `block_size` token ids; parent: the entry of the block before (None for a
    prompt's first block); ids: (L, Hkv) DRAM ids of the block in every sparse layer (host tensor);
    users: live requests whose cache adopted it; children: entries whose parent it is.
    """

    tokens: tuple[int, ...]
    parent: PrefixEntry | None
    ids: torch.Tensor
    key: int
    users: int = 0
    children: int = 0
    last_used: int = 0


def chain_key(parent_key: int | None, tokens: tuple[int, ...]) -> int:
    """The bucket of a block: a hash of its parent's key and its tokens (equal keys still compare tokens)."""
    return hash((parent_key, tokens))


class PrefixIndex:
    """Cached full blocks of earlier requests, by prefix (see the module docstring).

    Args:
        refs: the store whose blocks the entries reference.
        block_size: tokens per block.
    """

    def __init__(self, refs: BlockRefs, block_size: int) -> None:
        self.refs = refs
        self.block_size = block_size
        self._buckets: dict[int, list[PrefixEntry]] = {}
        self._clock = 0
        self.num_entries = 0
        self._pinned = 0  # head-blocks of entries with users

    def match(self, tokens: list[int]) -> list[PrefixEntry]:
        """The longest chain of cached blocks that `tokens` starts with (full blocks only), oldest first."""
        found: list[PrefixEntry] = []
        parent: PrefixEntry | None = None
        size = self.block_size
        for start in range(0, len(tokens) - size + 1, size):
            entry = self._find(parent, tuple(tokens[start : start + size]))
            if entry is None:
                break
            found.append(entry)
            parent = entry
        self._clock += 1
        for entry in found:
            entry.last_used = self._clock
        return found

    def insert(self, tokens: list[int], ids: torch.Tensor) -> int:
        """Index the first n full blocks of `tokens`, whose DRAM ids are `ids` (L, Hkv, n); returns
        how many entries are new. A block already indexed keeps its entry (and its ids): the
        index holds one reference per entry, taken here."""
        size, added = self.block_size, 0
        count = min(ids.shape[2], len(tokens) // size)
        parent: PrefixEntry | None = None
        for j in range(count):
            block = tuple(tokens[j * size : (j + 1) * size])
            entry = self._find(parent, block)
            if entry is None:
                entry = self._add(parent, block, ids[:, :, j].clone())
                added += 1
            parent = entry
        return added

    def acquire(self, entries: list[PrefixEntry]) -> None:
        """A live request adopted these entries' blocks: they stay until `release`."""
        for entry in entries:
            self._pinned += entry.ids.numel() if entry.users == 0 else 0
            entry.users += 1

    def release(self, entries: list[PrefixEntry]) -> None:
        """The request that acquired `entries` has ended."""
        for entry in entries:
            entry.users -= 1
            self._pinned -= entry.ids.numel() if entry.users == 0 else 0

    def reclaim(self, blocks: int) -> int:
        """Drop least recently used entries that no live request uses and no other entry extends,
        until `blocks` head-blocks are free again or nothing more can go; returns the head-blocks
        freed (a block a live request still holds stays: dropping its entry frees nothing)."""
        freed = 0
        while freed < blocks:
            leaves = [e for bucket in self._buckets.values() for e in bucket if e.users == 0 and e.children == 0]
            if not leaves:
                break
            freed += self._remove(min(leaves, key=lambda e: e.last_used))
        return freed

    def clear(self) -> None:
        """Drop every entry (its references go back to the store)."""
        for bucket in list(self._buckets.values()):
            for entry in bucket:
                self.refs.free(entry.ids.flatten())
        self._buckets.clear()
        self.num_entries = self._pinned = 0

    def pinned_blocks(self) -> int:
        """Head-blocks of entries a live request uses (they cannot be reclaimed), each counted once."""
        return self._pinned

    def _find(self, parent: PrefixEntry | None, tokens: tuple[int, ...]) -> PrefixEntry | None:
        for entry in self._buckets.get(_key(parent, tokens), ()):
            if entry.parent is parent and entry.tokens == tokens:
                return entry
        return None

    def _add(self, parent: PrefixEntry | None, tokens: tuple[int, ...], ids: torch.Tensor) -> PrefixEntry:
        self.refs.retain(ids.flatten())
        entry = PrefixEntry(tokens, parent, ids, _key(parent, tokens))
        entry.last_used = self._clock
        self._buckets.setdefault(entry.key, []).append(entry)
        if parent is not None:
            parent.children += 1
        self.num_entries += 1
        return entry

    def _remove(self, entry: PrefixEntry) -> int:
        bucket = self._buckets[entry.key]
        bucket.remove(entry)
        if not bucket:
            del self._buckets[entry.key]
        if entry.parent is not None:
            entry.parent.children -= 1
        self.num_entries -= 1
        return self.refs.free(entry.ids.flatten())


def _key(parent: PrefixEntry | None, tokens: tuple[int, ...]) -> int:
    """`chain_key` of a block under `parent` (looked up at call time: tests may replace it)."""
    return chain_key(None if parent is None else parent.key, tokens)
