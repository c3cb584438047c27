"""Moves: one block from one store into another, keeping the index right.

Every method here is one block's I/O on the calling thread: read it (memory
tiers: from a leased slot, so the slot is not reused meanwhile; ssd/remote:
a checked record), re-encode it only when the two tiers' codecs differ,
write it to the destination, then, under the index lock, switch the index
over and drop the source copy (``BlockStored`` on the destination, then
``BlockRemoved`` on the source). If the block was dropped, moved or pinned
meanwhile, the copy just written is deleted again unless the index places
the block there. A destination that fails is reported to the policy
(:meth:`~.policy.TierPolicy.io_failed`) and the block stays where it was.

Which blocks move, and where to, is the policy's (:mod:`~.policy`); which
thread moves them, and when, is :mod:`~.movement`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from itertools import repeat
from typing import Any

import numpy as np
import numpy.typing as npt

from kvfleet.agent.codecs import Codec, IdentityCodec, Payload, get_codec
from kvfleet.agent.tiers.base import TierStore
from kvfleet.agent.tiers.errors import (
    BlockNotFoundError,
    BlockTooLargeError,
    CorruptBlockError,
    TierError,
    TierFullError,
    TierIOError,
)
from kvfleet.agent.tiers.index import BlockIndex, Entry
from kvfleet.agent.tiers.memory import SlotStore
from kvfleet.agent.tiers.metrics import TierMetrics
from kvfleet.agent.tiers.policy import MEMORY, TierPolicy
from kvfleet.agent.tiers.record import BlockMeta, meta_for, payload_digest
from kvfleet.cache.hashing import BlockHash
from kvfleet.cache.tiers import Tier

log = logging.getLogger(__name__)

#: one block to store: hash, block, parent hash, token ids (:meth:`~.manager.TierManager.put_many`)
PutItem = tuple[BlockHash, npt.NDArray[Any], BlockHash | None, Sequence[int]]


class Mover:
    """Block moves between the open ``stores`` (see the module doc); thread-safe."""

    def __init__(self, stores: dict[Tier, TierStore], codecs: dict[Tier, Codec], index: BlockIndex,
                 policy: TierPolicy, metrics: TierMetrics) -> None:
        self.stores = stores
        self.codecs = codecs
        self.index = index
        self.policy = policy
        self.metrics = metrics

    # --------------------------------------------------------------- reads

    def read_memory(self, h: BlockHash, e: Entry) -> npt.NDArray[Any]:
        """Decode a memory-tier block (caller holds the lock): a view of its slot while pinned, else a
        copy."""
        meta, payload = self.stores[e.tier].read(h)
        block = get_codec(meta.codec).decode(payload, meta.dtype, meta.shape)
        if e.pins > 0:
            return block
        return np.array(block, copy=True) if np.shares_memory(block, payload) else block

    def read(self, tier: Tier, h: BlockHash) -> npt.NDArray[Any]:
        """Read and decode from a slow tier (outside the lock); errors are logged and counted."""
        meta, payload = self.read_raw(tier, h)
        return get_codec(meta.codec).decode(payload, meta.dtype, meta.shape)

    def read_raw(self, tier: Tier, h: BlockHash) -> tuple[BlockMeta, Payload]:
        """The encoded block from ``tier``; a corrupt one is dropped from the index, a failing tier
        reported."""
        try:
            meta, payload = self.stores[tier].read(h)
        except BlockNotFoundError:
            raise
        except CorruptBlockError as exc:
            log.error("%s tier: block %r is corrupt (%s); dropping it", tier, h, exc)
            self.metrics.child(self.metrics.errors, tier.value, "corrupt").inc()
            with self.index.lock:
                e = self.index.entries.get(h)
                if e is not None and e.tier == tier:
                    self.index.remove(h)
                    self.stores[tier].delete(h)
                    self.index.announce_removed(h, tier)
            raise
        except TierIOError as exc:
            self.policy.io_failed(tier, exc)
            raise
        return meta, payload

    def read_for_move(self, src: Tier, h: BlockHash) -> tuple[BlockMeta, Payload]:
        """The encoded block as stored (memory tiers: a private copy, the slot may be reused)."""
        if src in MEMORY:
            with self.index.lock:
                meta, payload = self.stores[src].read(h)
                return meta, np.array(payload, copy=True)
        return self.read_raw(src, h)

    # ----------------------------------------------------- stores (put path)

    def store_now(self, h: BlockHash, block: npt.NDArray[Any], tier: Tier, parent: BlockHash | None,
                  toks: tuple[int, ...]) -> Tier:
        """Store a new block in the memory tier ``tier`` on the caller's thread (TierFullError,
        BlockTooLargeError)."""
        codec = self.codecs[tier]
        meta = meta_for(h, block, codec.name, parent, toks)
        store = self.stores[tier]
        index = self.index
        if isinstance(store, SlotStore) and (not codec.lossless or store.lends):
            # Straight into the slot, outside the locks (a writer indexing a block it wrote must not wait
            # for this copy): a quantizing codec encodes in place, and a host slot takes a lossless
            # block's bytes in one copy. (A device store copies a lossless block to the device in
            # one transfer at ``write`` instead of through a reserved host buffer.)
            nbytes = codec.encoded_nbytes(block.dtype, block.shape)
            slot, view = store.reserve(nbytes)
            try:
                codec.encode_into(block, view)
            except BaseException:
                store.abort(slot)
                raise
            with index.lock:
                if h in index.entries:
                    store.abort(slot)
                    return index.entries[h].tier
                charge = store.commit(slot, meta, nbytes)
                index.add(h, tier, meta, charge)
                index.announce_stored(meta, tier)
                if self.policy.over_high(tier):  # only the demotion thread waits for a store
                    index.wake.notify_all()
        else:
            payload = codec.encode(block)
            nbytes = payload.nbytes
            with index.lock:
                if h in index.entries:
                    return index.entries[h].tier
                charge = store.write(meta, payload)
                index.add(h, tier, meta, charge)
                index.announce_stored(meta, tier)
                if self.policy.over_high(tier):
                    index.wake.notify_all()
        m = self.metrics
        m.child(m.stores, tier.value).inc()
        if meta.raw_nbytes > nbytes:
            m.child(m.codec_saved, tier.value, codec.name).inc(meta.raw_nbytes - nbytes)
        return tier

    def store_batch(self, tier: Tier, items: Sequence[PutItem]) -> tuple[int, list[PutItem]]:
        """Store new blocks in the memory tier ``tier`` (a slot store with a lossless codec), in order,
        without counting them.

        The caller holds the index lock from checking that none of ``items`` is held until this
        returns (so no store races with another), and has made room. Returns how many were stored,
        and the items that found no slot (the first one without a slot and those after it).
        """
        codec, store = self.codecs[tier], self.stores[tier]
        assert isinstance(store, SlotStore) and codec.lossless
        name, encode = codec.name, codec.encode
        metas: list[BlockMeta] = []
        # a batch's blocks mostly share dtype and shape: the meta's dtype name and sizes are worked out once
        like: BlockMeta | None = None
        like_dtype: np.dtype[Any] | None = None
        kinds = 0  # how many times the dtype or shape changed along the batch
        for h, block, parent, token_ids in items:
            # a tuple of Python ints (what an engine passes) is kept as it is; anything else is converted
            toks = (token_ids if type(token_ids) is tuple and (not token_ids or type(token_ids[0]) is int)
                    else tuple(map(int, token_ids)))
            if like is not None and block.dtype is like_dtype and block.shape == like.shape:
                metas.append(BlockMeta(h, name, like.dtype, like.shape, like.raw_nbytes, parent, toks))
            else:
                like, like_dtype = meta_for(h, block, name, parent, toks), block.dtype
                metas.append(like)
                kinds += 1
        if kinds == 1 and len(items) > 1 and isinstance(codec, IdentityCodec):
            # the stored bytes are the blocks' own: one array of rows, copied into the slots at once
            n = self._index_rows(tier, metas, np.stack([item[1] for item in items]))
        else:
            n = store.write_many([(meta, encode(item[1])) for meta, item in zip(metas, items, strict=True)])
            self._indexed(tier, metas[:n])
        return n, list(items[n:])

    def store_rows(self, tier: Tier, hashes: Sequence[BlockHash], rows: npt.NDArray[Any],
                   parents: Sequence[BlockHash | None], token_ids: Sequence[tuple[int, ...]]) -> int:
        """:meth:`store_batch` of blocks given as the rows of one array (``rows[i]`` the block of
        ``hashes[i]``, ``token_ids[i]`` a tuple); returns how many were stored, the first ones in order.

        The metas are made in one pass without a Python call per block, the rows copied as they are.
        """
        if not len(hashes) == len(rows) == len(parents) == len(token_ids):
            raise ValueError(f"{len(hashes)} hashes, {len(rows)} rows, {len(parents)} parents and "
                             f"{len(token_ids)} token id tuples: one of each per block")
        if not len(hashes):
            return 0
        codec = self.codecs[tier]
        if not isinstance(codec, IdentityCodec):  # lossless but re-encoded: the general path
            items = list(zip(hashes, rows, parents, token_ids, strict=True))
            return self.store_batch(tier, items)[0]
        if token_ids[0] and type(token_ids[0][0]) is not int:  # e.g. numpy ints: as store_batch takes them
            token_ids = [tuple(map(int, t)) for t in token_ids]
        first = meta_for(hashes[0], rows[0], codec.name, None, ())
        metas = list(map(tuple.__new__, repeat(BlockMeta), zip(
            hashes, repeat(codec.name), repeat(first.dtype), repeat(first.shape), repeat(first.raw_nbytes),
            parents, token_ids)))  # the lengths are checked above (repeat() never ends: no strict)
        return self._index_rows(tier, metas, rows)

    def _index_rows(self, tier: Tier, metas: list[BlockMeta], rows: npt.NDArray[Any]) -> int:
        """Write ``rows`` (one per meta) into the slot store of ``tier`` and index what was written."""
        store = self.stores[tier]
        assert isinstance(store, SlotStore)
        n = store.write_rows(metas, np.ascontiguousarray(rows).reshape(len(metas), -1).view(np.uint8))
        self._indexed(tier, metas[:n])
        return n

    def _indexed(self, tier: Tier, metas: list[BlockMeta]) -> None:
        """Index (and announce) blocks just stored in the memory tier ``tier``; wake the demotion thread
        when the tier went over its high watermark."""
        index, store = self.index, self.stores[tier]
        assert isinstance(store, SlotStore)
        index.add_many(tier, metas, store.slot_bytes)
        if metas and self.policy.over_high(tier):
            index.wake.notify_all()

    def write_new(self, h: BlockHash, block: npt.NDArray[Any], meta: BlockMeta, dst: Tier,
                  digest: int | None = None) -> None:
        """Write a spilled ``put`` (a staged copy; ``digest`` its payload digest) to ``dst`` or the next
        persistent tier with room, then index it."""
        index = self.index
        for t in self.policy.write_targets(dst):
            if not self.policy.available(t):
                continue
            codec = self.codecs[t]
            tmeta = BlockMeta(h, codec.name, meta.dtype, meta.shape, meta.raw_nbytes, meta.parent,
                              meta.token_ids)
            payload = codec.encode(block)
            try:
                # the staged bytes are the payload only under the identity codec
                identity = isinstance(codec, IdentityCodec)
                charge = self.stores[t].write(tmeta, payload, digest if identity else None)
            except (TierFullError, BlockTooLargeError):
                continue
            except TierIOError as exc:
                self.policy.io_failed(t, exc)
                continue
            with index.lock:
                e = index.entries.get(h)
                if e is not None:  # put again meanwhile; same hash, same bytes
                    if e.tier != t:
                        quiet_delete(self.stores[t], h)
                    return
                if not self.stores[t].contains(h):  # evicted meanwhile
                    continue
                index.add(h, t, tmeta, charge)
                index.announce_stored(tmeta, t)
                index.wake.notify_all()
            self.metrics.child(self.metrics.stores, t.value).inc()
            return
        log.warning("block %r not cached: every slow tier is full or failing", h)
        self.metrics.child(self.metrics.errors, dst.value, "write_dropped").inc()

    # --------------------------------------------------------------- moves

    def write_moved(self, h: BlockHash, source: tuple[BlockMeta, Payload], src: Tier, dst: Tier,
                    kind: str, digest: int | None = None) -> bool:
        """Write the block to ``dst`` then, if ``h`` is still in ``src`` and movable, switch it over.

        The payload is re-encoded only when the two tiers use different codecs (``digest``, the source
        payload's digest when known, is used only when it is not). ``False``: ``dst`` has no room or
        failed; ``True``: moved, or nothing left to do.
        """
        codec = self.codecs[dst]
        store = self.stores[dst]
        index = self.index
        with index.lock:
            e = index.entries.get(h)
            if e is None or e.tier != src:
                return True  # gone or moved meanwhile: nothing to do
            meta = BlockMeta(h, codec.name, e.meta.dtype, e.meta.shape, e.meta.raw_nbytes, e.meta.parent,
                             e.meta.token_ids)
        src_meta, src_payload = source
        if src_meta.codec == codec.name:
            payload = src_payload
        else:
            block = get_codec(src_meta.codec).decode(src_payload, src_meta.dtype, src_meta.shape)
            payload = codec.encode(block)
            digest = None
        try:
            charge = store.write(meta, payload, digest)
        except (TierFullError, BlockTooLargeError):
            return False
        except TierIOError as exc:
            self.policy.io_failed(dst, exc)
            return False
        with index.lock:
            e = index.entries.get(h)
            if e is None or e.tier != src or (kind == "demote" and e.pins):
                # Handled: gone, moved or pinned meanwhile. Stores are keyed by hash, so the copy
                # just written is only ours to delete if the index does not place the block there.
                if e is None or e.tier != dst:
                    quiet_delete(store, h)
                return True
            if not store.contains(h):  # deleted by another mover's clean-up meanwhile
                return False
            self.switch(h, e, src, dst, meta, charge)
        self.count_move(src, dst, kind, meta, payload.nbytes)
        return True

    def switch(self, h: BlockHash, e: Entry, src: Tier, dst: Tier, meta: BlockMeta, charge: int) -> None:
        """Point the index at ``dst`` and drop the ``src`` copy (caller holds the lock)."""
        self.index.relocate(h, e, dst, meta, charge)
        try:
            self.stores[src].forget(h)
        except TierIOError as exc:
            self.policy.io_failed(src, exc)
        self.index.announce_stored(meta, dst)
        self.index.announce_removed(h, src)
        self.index.wake.notify_all()

    def count_move(self, src: Tier, dst: Tier, kind: str, meta: BlockMeta, nbytes: int) -> None:
        m = self.metrics
        m.child(m.migrations, src.value, dst.value, kind).inc()
        m.child(m.migrated_bytes, src.value, dst.value, kind).inc(nbytes)
        m.child(m.codec_saved, dst.value, meta.codec).inc(max(0, meta.raw_nbytes - nbytes))

    def move_down(self, src: Tier, h: BlockHash, lower: list[Tier], digest: int | None = None) -> int:
        """Demote ``h`` from ``src`` into the first of ``lower`` with room; 1 if it moved (or needs
        nothing). ``digest``: its payload's :meth:`digest` when taken beforehand."""
        if not lower:
            return 0
        store = self.stores[src]
        if isinstance(store, SlotStore):
            # Write straight from the slot: the lease keeps it from being reused meanwhile.
            try:
                meta, view, slot = store.lease(h)
            except BlockNotFoundError:
                return 0
            try:
                return int(any(self.write_moved(h, (meta, view), src, dst, kind="demote", digest=digest)
                               for dst in lower))
            finally:
                store.release(slot)
        try:
            source = self.read_for_move(src, h)
        except TierError:
            return 0
        return int(any(self.write_moved(h, source, src, dst, kind="demote") for dst in lower))

    def digest(self, src: Tier, h: BlockHash) -> int | None:
        """The payload digest of ``h`` in the memory tier ``src`` (``None`` when it is not there).

        Taken for the blocks a demotion batch writes next (:meth:`~.movement.Movement._demote_batch`):
        a block read from memory right before its write slows the write itself on a disk that copies
        it out of the guest's memory, one read a block or two earlier does not. Should the slot be
        rewritten meanwhile, the record fails its checksum when read: a miss, never wrong data.
        """
        store = self.stores[src]
        if not isinstance(store, SlotStore):
            return None
        try:
            _, view, slot = store.lease(h)
        except BlockNotFoundError:
            return None
        try:
            return payload_digest(view)
        finally:
            store.release(slot)

    def evict(self, tier: Tier, victims: list[BlockHash]) -> int:
        """Drop ``victims`` from ``tier`` (the last tier, or a persistent one with every tier below
        failing)."""
        m = self.metrics
        index = self.index
        with index.lock:
            gone, nbytes = index.remove_unpinned(tier, victims)
            try:
                self.stores[tier].delete_many(gone)
            except TierIOError as exc:
                self.policy.io_failed(tier, exc)
            index.announce_removed_many(gone, tier)
        n = len(gone)
        if n:
            m.child(m.evictions, tier.value).inc(n)
            m.child(m.evicted_bytes, tier.value).inc(nbytes)
        return n

    def promote_direct(self, h: BlockHash, src: Tier, dst: Tier) -> bool | None:
        """Read an ssd record straight into a free slot of a memory tier (same codec): one copy.

        ``None`` when not applicable (other stores or codecs), else like :meth:`write_moved`.
        """
        src_store, dst_store = self.stores[src], self.stores[dst]
        if not src_store.reads_into or not isinstance(dst_store, SlotStore):
            return None
        index = self.index
        with index.lock:
            e = index.entries.get(h)
            if e is None or e.tier != src:
                return True
            if e.meta.codec != self.codecs[dst].name:
                return None
        reserved: list[tuple[int, int]] = []

        def alloc(meta: BlockMeta, nbytes: int) -> Payload:
            slot, view = dst_store.reserve(nbytes)
            reserved.append((slot, nbytes))
            return view

        try:
            meta = src_store.read_into(h, alloc)
        except (TierFullError, BlockTooLargeError):
            return False
        except TierError:
            for slot, _ in reserved:
                dst_store.abort(slot)
            self.read_raw(src, h)  # the normal path logs, counts and drops what is broken
            return False
        slot, nbytes = reserved[0]
        with index.lock:
            e = index.entries.get(h)
            if e is None or e.tier != src:
                dst_store.abort(slot)
                return True
            charge = dst_store.commit(slot, meta, nbytes)
            self.switch(h, e, src, dst, meta, charge)
        self.count_move(src, dst, "promote", meta, nbytes)
        return True

    def promote(self, h: BlockHash, block: npt.NDArray[Any] | None) -> None:
        """Move ``h`` up to the fastest tier with room (``block``: its decoded bytes when already read)."""
        index = self.index
        with index.lock:
            e = index.entries.get(h)
            if e is None or e.moving or e.tier == self.policy.order[0]:
                return
            src = e.tier
            e.moving = True
        try:
            faster = self.policy.faster(src)
            if block is None:
                for dst in faster:
                    done = self.promote_direct(h, src, dst)
                    if done is None:
                        break
                    if done:
                        return
            if block is not None:
                plain = get_codec("none")
                source = (BlockMeta(h, plain.name, block.dtype.name, block.shape), plain.encode(block))
            else:
                source = self.read_for_move(src, h)
            for dst in faster:
                if self.write_moved(h, source, src, dst, kind="promote"):
                    return
                with index.lock:
                    index.wake.notify_all()  # make room upstream for the next try
        except TierError as exc:
            log.warning("%s tier: promotion of %r failed: %s", src, h, exc)
        finally:
            index.unmark(h)

    def flush_memory(self) -> None:
        """Write the memory tiers' blocks (most recently used first) to the persistent tiers while there is
        room."""
        persistent = self.policy.persistent()
        flushed = 0
        for tier in (t for t in self.policy.order if t in MEMORY):
            with self.index.lock:
                hashes = list(reversed(self.index.lru[tier]))
            for h in hashes:
                try:
                    source = self.read_for_move(tier, h)
                except TierError:
                    continue
                if not any(self.write_moved(h, source, tier, dst, kind="demote") for dst in persistent):
                    break  # no room left
                flushed += 1
        if flushed:
            log.info("flushed %d block(s) from memory tiers to %s before closing", flushed,
                     ", ".join(persistent))


def quiet_delete(store: TierStore, h: BlockHash) -> None:
    try:
        store.delete(h)
    except TierError as exc:
        log.warning("%s tier: cannot delete %r: %s", store.tier, h, exc)


__all__ = ["Mover", "PutItem", "quiet_delete"]
