"""The checks every record a peer sends passes before this node stores it, without I/O.

:class:`Intake` takes the records of one gossip frame (pushed or pulled) with the
certificates that vouch for their owners: a record is stored only if its signature verifies,
its owner is not banned and, in certificate mode, holds a valid certificate of the run; a
membership record must also decode. It calls the node's watchers for what was news, warns
once per owner over its store quota, and raises :class:`~peer.exceptions.ProtocolError` for
a frame that carried anything forged, so that the gossip layer drops the link.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from peer.exceptions import ProtocolError
from peer.node.gossip import MEMBERS_KEY, GossipStore, Record, RecordError
from peer.node.membership import decode_member
from peer.node.trust import Trust

logger = logging.getLogger("peer.node")

__all__ = ["Intake"]

#: owners warned about for their store quota, at most (bounded, whoever mints keys)
MAX_WARNED = 1024


class Intake:
    """Verify and store the records peers send. ``trust`` knows the certificates and bans;
    ``watchers`` maps a key to the callbacks to call when a record under it is news."""

    def __init__(self, trust: Trust, watchers: dict[str, list[Callable[[], None]]]) -> None:
        self.trust = trust
        self._watchers = watchers
        self._quota_warned: set[str] = set()  # owners warned about for their store quota

    def accept(
        self,
        store: GossipStore,
        items: Sequence[object],
        sender: str,
        certs: Sequence[list[bytes]],
        now: float,
    ) -> list[Record]:
        """Verify ``items`` (wire records ``sender`` sent) and put them in ``store``; the
        records that were news. In certificate mode, ``certs`` vouch for owners this node
        does not know yet, and a record whose owner holds no valid certificate of the run is
        refused. ProtocolError if any record or certificate was invalid."""
        rejected = 0
        fresh = []
        book = self.trust.certificates
        if book is not None:
            for owner, certificate in certs:
                if self.trust.banned(owner):
                    continue
                try:
                    book.offer(owner, certificate, now)
                except RecordError as exc:
                    rejected += 1
                    if rejected == 1:
                        logger.warning("rejected a certificate sent by %s: %s", sender, exc)
        for item in items:
            try:
                record = Record.from_wire(item)
                if store.holds(record, now):
                    continue  # this very copy is held (checked when it came): not news
                if self.trust.banned(record.owner):
                    continue  # a relay may not know of the ban yet: not its fault
                if book is not None and not book.valid(record.owner, now):
                    raise RecordError(
                        f"its owner, peer {record.owner_id}, holds no valid certificate of this run"
                    )
                if record.key == MEMBERS_KEY:
                    decode_member(record)
                record.verify()
            except (RecordError, ValueError) as exc:
                rejected += 1
                if rejected == 1:
                    logger.warning("rejected a record relayed by %s: %s", sender, exc)
                continue
            if not store.put(record, now):
                self._warn_if_over(store, record, sender, now)
                continue
            fresh.append(record)
            for callback in list(self._watchers.get(record.key, ())):
                try:
                    callback()
                except Exception:
                    logger.exception("a watcher of %r failed", record.key)
        if rejected:
            # A peer that relays forged records is either malicious or broken: drop the link.
            raise ProtocolError(f"{rejected} invalid record(s) relayed")
        return fresh

    def _warn_if_over(self, store: GossipStore, record: Record, sender: str, now: float) -> None:
        """``store`` refused ``record``: warn, once per owner, if its owner is over its
        quota or share of the store (rather than the record being no news)."""
        held = store.current(record, now)
        over = (
            None  # not news: what the slot holds is as new
            if held is not None and not record.newer_than(held)
            else "its quota in the gossip store"
            if store.over_quota(record)
            else "its share of the full gossip store"
            if store.over_share(record)
            else None
        )
        if over is None or record.owner_id in self._quota_warned:
            return
        if len(self._quota_warned) >= MAX_WARNED:
            self._quota_warned.clear()
        self._quota_warned.add(record.owner_id)
        logger.warning(
            "peer %s is over %s (relayed by %s): its further records are dropped",
            record.owner_id,
            over,
            sender,
        )
