"""The transfer engine: move KV blocks prefill → decode, pipelined, with failover.

Layers (each imports only those above it):

==============  ============================================  ===========================
module          cares about                                   in → out
==============  ============================================  ===========================
``errors``      typed failures that decide retry vs. fail     —
``frames``      the 64-byte header, control bodies            values ↔ bytes
``auth``        HMAC challenge, session keys, frame tags      nonces → keys, frames → MACs
``channel``     one socket: sendmsg / recv_into, tags         frames ↔ socket
``shm``         the same-host shared-memory ring              slots
``mooncake``    Mooncake Transfer Engine rings (optional)     registered slots
``topology``    which backend for which peer                  PeerInfo × PeerInfo → names
``source``      where sent blocks come from                   hash → bytes
``metrics``     Prometheus series                             events → counters
``backoff``     retry delays: exponential, capped, jittered   attempt → seconds
``handshake``   a server connection before its AUTH           socket → verified AUTH
``server``      serve blocks to authenticated peers           BlockSource → wire
``connection``  handshake, streams, credits, idle pool        peer → authenticated streams
``handle``      the asyncio face: in order, exactly once      landed blocks → Block
``failover``    sessions, receive + verify, retries           streams → landed blocks
``client``      ``TransferClient.pull``                       hashes → TransferHandle
==============  ============================================  ===========================

Typical use (a decode pod pulling from a prefill pod)::

    async with TransferServer(store, secret) as srv:          # prefill side
        ...
    client = TransferClient(secret)                           # decode side
    handle = client.pull(("10.0.0.7", 7400), hashes)
    async for block in handle:                                # in sequence order
        engine.load(block.block_hash, block.data)
"""

from kvfleet.agent.transfer import auth, mooncake
from kvfleet.agent.transfer.client import (
    Allocator,
    Block,
    Peer,
    TransferClient,
    TransferHandle,
    TransferStats,
)
from kvfleet.agent.transfer.errors import (
    AuthError,
    BlockNotFoundError,
    ChecksumError,
    FrameError,
    IntegrityError,
    StreamError,
    TransferCancelled,
    TransferError,
    UnknownBackendError,
    VersionError,
)
from kvfleet.agent.transfer.metrics import TransferMetrics
from kvfleet.agent.transfer.server import TransferServer
from kvfleet.agent.transfer.source import BlockSource, MemoryBlockStore
from kvfleet.agent.transfer.topology import PeerInfo, choose_backends, local_host_id

__all__ = [
    "Allocator",
    "AuthError",
    "Block",
    "BlockNotFoundError",
    "BlockSource",
    "ChecksumError",
    "FrameError",
    "IntegrityError",
    "MemoryBlockStore",
    "Peer",
    "PeerInfo",
    "StreamError",
    "TransferCancelled",
    "TransferClient",
    "TransferError",
    "TransferHandle",
    "TransferMetrics",
    "TransferServer",
    "TransferStats",
    "UnknownBackendError",
    "VersionError",
    "auth",
    "choose_backends",
    "local_host_id",
    "mooncake",
]
