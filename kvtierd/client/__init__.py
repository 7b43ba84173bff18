"""Client library for kvtierd: put/get numpy arrays and torch tensors, zero-copy through the
daemon's shared-memory arena when co-located, streamed otherwise.

``KVClient`` blocks; ``AsyncKVClient`` is the asyncio twin with the same methods.
"""

from kvtierd.client.aio import AsyncKVClient
from kvtierd.client.common import Endpoint, LookupResult
from kvtierd.client.sync import KVClient

__all__ = ["AsyncKVClient", "Endpoint", "KVClient", "LookupResult"]
