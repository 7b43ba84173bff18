"""Tiers whose objects are blocks of one memory pool the daemon maps: the CPU tier's arena and
a gpu tier's CUDA pool. A reader can be leased such a block in place; when the object is moved
or deleted under a lease, the engine detaches the block from the index and frees it only after
the last release."""

from __future__ import annotations

from abc import abstractmethod

from kvtierd.storage.allocator import Block
from kvtierd.storage.base import Tier


class PooledTier(Tier):
    @abstractmethod
    def block_of(self, key: str) -> Block:
        """The block holding an object's bytes."""

    @abstractmethod
    def detach(self, key: str) -> Block:
        """Forget the object but keep its block (freed later by :meth:`free_block`)."""

    @abstractmethod
    def free_block(self, block: Block) -> None:
        """Return a detached block to the pool."""
