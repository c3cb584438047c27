"""The remote tier over the Redis protocol (Redis, Valkey): one key per block.

Keys are ``{key_prefix}:{pool}:{model}:{key_name(hash)}`` and values the same
self-describing records as the SSD tier (:mod:`~.record`), so a block written
by one agent is verified (checksum) by whichever agent reads it. At start-up
:meth:`RedisStore.scan` lists the namespace with ``SCAN`` and reads only each
record's prefix and header (``GETRANGE``), dropping records whose length or
header is wrong.

A server that cannot be reached raises :class:`TierUnavailableError`; the
manager then skips the tier for ``retry_after_s`` and keeps serving from the
others. Capacity is accounted by this agent for the keys it knows about
(other agents' writes into the same namespace are not charged here).
"""

from __future__ import annotations

from typing import Any

import redis

from kvfleet.agent.codecs import Payload, as_payload
from kvfleet.agent.tiers.base import RecordStore, ScanReport
from kvfleet.agent.tiers.errors import (
    BlockNotFoundError,
    CorruptBlockError,
    TierUnavailableError,
)
from kvfleet.agent.tiers.record import (
    PREFIX_SIZE,
    BlockMeta,
    decode_header,
    hash_from_key,
    key_name,
    pack,
    read_prefix,
    unpack,
)
from kvfleet.cache.hashing import BlockHash
from kvfleet.cache.tiers import Tier
from kvfleet.config.tiers import RemoteTierSpec, TierSpec

_HEADER_PROBE = 4096
_REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, ConnectionError, OSError)


class RedisStore(RecordStore):
    """Blocks as Redis strings in a pool/model namespace."""

    backend = "redis"

    def __init__(self, tier: Tier, spec: TierSpec) -> None:
        super().__init__(tier, spec)
        rspec = spec if isinstance(spec, RemoteTierSpec) else RemoteTierSpec()
        self.namespace = f"{rspec.key_prefix}:{rspec.pool}:{rspec.model}:"
        self._client: Any = redis.Redis.from_url(
            rspec.url,
            socket_timeout=rspec.socket_timeout_s,
            socket_connect_timeout=rspec.socket_timeout_s,
            retry_on_timeout=False,
        )
        self.url = rspec.url

    def describe(self) -> str:
        return (f"{self.tier} tier: redis {self.url} namespace {self.namespace!r}, "
                f"capacity {self.capacity_bytes} bytes")

    def key(self, block_hash: BlockHash) -> str:
        return self.namespace + key_name(block_hash)

    def write(self, meta: BlockMeta, payload: Payload, digest: int | None = None) -> int:
        head, body = pack(meta, payload, digest=digest)
        size = len(head) + body.nbytes
        with self._lock:
            self._check_room(meta.hash, size)
        try:
            self._client.set(self.key(meta.hash), head + body.tobytes())
        except _REDIS_DOWN as exc:
            raise TierUnavailableError(f"{self.tier}: redis {self.url} unreachable: {exc}") from exc
        with self._lock:
            self._account(meta.hash, size)
        return size

    def read(self, block_hash: BlockHash) -> tuple[BlockMeta, Payload]:
        try:
            raw = self._client.get(self.key(block_hash))
        except _REDIS_DOWN as exc:
            raise TierUnavailableError(f"{self.tier}: redis {self.url} unreachable: {exc}") from exc
        if raw is None:
            raise BlockNotFoundError(block_hash)
        meta, payload = unpack(raw)
        if meta.hash != block_hash:
            raise CorruptBlockError(f"key {self.key(block_hash)} holds block {meta.hash!r}",
                                    reason="mismatch")
        return meta, as_payload(payload)

    def delete(self, block_hash: BlockHash) -> None:
        with self._lock:
            self._forget(block_hash)
        try:
            self._client.delete(self.key(block_hash))
        except _REDIS_DOWN as exc:
            raise TierUnavailableError(f"{self.tier}: redis {self.url} unreachable: {exc}") from exc

    def scan(self) -> ScanReport:
        report = ScanReport()
        try:
            names = [k.decode() if isinstance(k, bytes) else k
                     for k in self._client.scan_iter(match=self.namespace + "*", count=1000)]
            pipe = self._client.pipeline(transaction=False)
            for name in names:
                pipe.strlen(name)
                pipe.getrange(name, 0, _HEADER_PROBE - 1)
            replies = pipe.execute()
        except _REDIS_DOWN as exc:
            raise TierUnavailableError(f"{self.tier}: redis {self.url} unreachable: {exc}") from exc
        bad: list[str] = []
        for i, name in enumerate(names):
            length, head = replies[2 * i], replies[2 * i + 1]
            try:
                expected = hash_from_key(name[len(self.namespace) :])
            except ValueError:
                report.drop("foreign")
                continue
            try:
                header_len, payload_len, _ = read_prefix(head)
                if length != PREFIX_SIZE + header_len + payload_len:
                    report.drop("truncated")
                    bad.append(name)
                    continue
                if PREFIX_SIZE + header_len > len(head):
                    head = self._client.getrange(name, 0, PREFIX_SIZE + header_len - 1)
                meta = decode_header(head[PREFIX_SIZE : PREFIX_SIZE + header_len])
            except CorruptBlockError as exc:
                report.drop(exc.reason)
                bad.append(name)
                continue
            if meta.hash != expected:
                report.drop("mismatch")
                bad.append(name)
                continue
            with self._lock:
                self._account(expected, length)
            report.blocks.append(meta)
        if bad:
            try:
                self._client.delete(*bad)
            except _REDIS_DOWN as exc:
                raise TierUnavailableError(f"{self.tier}: redis {self.url} unreachable: {exc}") from exc
        return report

    def close(self) -> None:
        self._client.close()
