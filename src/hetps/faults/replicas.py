"""A server's copies of its keys on other servers (HETPS_REPLICAS), as a part of
:class:`hetps.kvstore.server.KVServer`. (docs/MODULES.md, "hetps.faults.replicas")"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from hetps import optim
from hetps.cluster import protocol as P
from hetps.cluster.errors import RequestError
from hetps.kvstore.aggregate import writable
from hetps.kvstore.ports import ServerPort
from hetps.kvstore.slices import BadRequest, Slice, short, slice_key
from hetps.tables.server_replicas import TABLE_OPS
from hetps.transport.codec import WIRE_DTYPES, Message

log = logging.getLogger("hetps.server")


@dataclass(slots=True, eq=False)
class _Copy:
    """A copy on its way to the replicas: who has yet to acknowledge it, and what then."""

    waiting: set[int]
    then: Any
    errors: list | None = None  # where live replicas' refusals are told (None: not kept)
    done: bool = False


class Replication:
    """The replication policy of a :class:`~hetps.kvstore.server.KVServer` (``server``: its
    slices, answers, optimizer and aggregator): which servers keep copies of what it serves,
    and the copies it sends and takes."""

    def __init__(self, server: ServerPort) -> None:
        self.server = server
        self.node = server.node
        self.slices = server.slices
        self.answers = server.answers
        self._copies: list[_Copy] = []  # copies on their way, each waiting for its acks
        # (key, part) -> why it has no working copy: a live replica refused the whole slice
        # (it serves that slice itself, say), so the next death could lose it. Every request
        # of such a slice is refused with this text, and the job fails, instead of going on
        # with one copy or waiting for a round that two servers each think is theirs
        self.broken: dict[tuple[Any, int], str] = {}

    @property
    def replicated(self) -> bool:
        """Whether keys have copies on other servers (pushes then carry their round)."""
        return getattr(self.node, "replicas", 1) > 1

    def replicas(self) -> list[int]:
        """The servers that keep copies of what this one serves: the next REPLICAS-1 live
        servers in rank order (the first of them takes over if this one dies)."""
        node = self.node
        if getattr(node, "replicas", 1) <= 1:
            return []
        live = node.live_servers()
        me = next((i for i, n in enumerate(live) if n.id == node.id), None)
        if me is None:
            return []
        after = live[me + 1 :] + live[:me]
        return [n.id for n in after[: node.replicas - 1]]

    def copy_out(
        self, body: dict, data: np.ndarray | list, then, errors: list | None = None
    ) -> None:
        """Send ``body`` with ``data`` (an array, or a list of them: not changed until every
        replica answered) to every replica; ``then()`` runs once each acknowledged it, or
        died. ``errors`` gets each live replica's refusal (its server and the error)."""
        peers = self.replicas()
        if not peers:
            then()
            return
        copy = _Copy(set(peers), then, errors)
        self._copies.append(copy)
        arrays = data if isinstance(data, list) else [data]
        for peer in peers:
            fut = self.node.request(
                peer,
                Message(P.REPLICATE, body=body, arrays=arrays),
                callback=lambda _reply, peer=peer: self._copied(copy, peer, None),
                what=f"{_about(body)} to {self.node.describe(peer)}",
            )
            fut.errback = lambda exc, peer=peer: self._copied(copy, peer, exc)
            if fut.error is not None:
                self._copied(copy, peer, fut.error)

    def _copied(self, copy: _Copy, peer: int, error: BaseException | None) -> None:
        if error is not None and peer not in getattr(self.node, "down", ()):
            # a live replica that refused a copy (it lacked the slice, or a round): it gets
            # the whole of what we serve again, behind which later rounds go on
            log.warning("server: a replica did not take a copy (%s); sending it all again", error)
            if copy.errors is not None:
                copy.errors.append(f"{self.node.describe(peer)}: {error}")
            self.resync()
        copy.waiting.discard(peer)
        if not copy.waiting and not copy.done:
            copy.done = True
            self._copies.remove(copy)
            copy.then()

    def drop(self, msg: Message) -> None:
        """Slices a plan moved away (HETPS_BALANCE), after every worker's moves landed."""
        items = msg.typed.slices
        if not all(_drop_item(i) for i in items):
            raise BadRequest(
                "drop: field 'slices' must be a list of [key, part] or [key, part, to]"
            )
        if not self.replicated:
            for item in items:
                self.slices.pop((item[0], item[1]), None)
            self.answers.reply(msg)
            return
        # HETPS_REPLICAS: a plan moved these slices away, to server ``to``. What is served
        # here goes (a copy of the new primary's stays), and so do the replicas' copies of
        # it; unless this server serves what the plan gave ``to`` (it took ``to``'s keys over,
        # or is ``to`` itself: a server died between the move and the drop)
        redirect = getattr(self.node, "redirect", {})
        gone = []
        for item in items:
            if len(item) == 3 and redirect.get(item[2], item[2]) == self.node.id:
                continue
            sl = self.slices.get((item[0], item[1]))
            if sl is not None and sl.primary:
                del self.slices[(item[0], item[1])]
            gone.append(item[:2])
        body = {"op": "drop", "slices": gone}
        self.copy_out(body, np.zeros(0, np.uint8), lambda: self.answers.reply(msg))

    def on_failover(self, dead: int, to: int) -> None:
        """A server died (the receive thread calls this, between handlers): copies waiting
        for it wait no more; its copies here are ours now if we took over (else the server
        that did sends them from now on); and the replicas, which may have changed, get what
        we serve."""
        for copy in list(self._copies):
            if dead in copy.waiting:
                self._copied(copy, dead, None)
        me = getattr(self.node, "id", None)
        for sl in self.slices.values():
            if sl.origin == dead:
                if to == me:
                    sl.primary, sl.origin = True, None
                else:
                    sl.origin = to
        self.server.tables.copies.on_failover(dead, to, me)  # (the tables' parts alike)
        self.resync()

    def on_rejoin(self, nid: int) -> None:
        """A server is back: it may be one of our replicas now, with nothing of ours."""
        self.resync()

    def resync(self) -> None:
        """Send every replica the whole of what this server serves: the optimizer, then each
        slice's value, optimizer state and round count (op ``sync``); a replica takes them
        in place of what it had. Rounds applied after go as usual, behind them on the same
        connection. A replica that already had it all loses nothing."""
        peers = self.replicas()
        mine = [sl for sl in self.slices.values() if sl.primary]
        # the row-sparse keys' parts served here, in ssync copies (tables/server_replicas.py)
        parts = self.server.tables.copies.sync_messages() if peers else []
        if not peers or not (mine or parts):
            return
        nparts = len({(b["k"], b["part"]) for b, _ in parts})  # (ssync copies: each has both)
        for peer in peers:
            left = [len(mine) + len(parts) + (self.server.optimizer_blob is not None)]

            def taken(_reply, peer=peer, left=left) -> None:
                left[0] -= 1
                if left[0] == 0:
                    log.warning(
                        "server: %s holds a copy of each of the %d slices and %d table parts "
                        "this server serves",
                        self.node.describe(peer),
                        len(mine),
                        nparts,
                    )

            if self.server.optimizer_blob is not None:
                blob = np.frombuffer(self.server.optimizer_blob, np.uint8)
                self._copy_to(peer, {"op": "optimizer"}, [blob], taken)
            for sl in mine:
                body = {
                    "op": "sync",
                    "k": sl.key,
                    "part": sl.part,
                    "shape": list(sl.shape),
                    "dtype": sl.value.dtype.name,
                    "rnd": sl.rounds,
                }
                arrays = [np.array(sl.value)]
                if sl.has_state:
                    states = optim.dump_states({sl.skey: sl.state})
                    arrays.append(np.frombuffer(states, np.uint8))
                self._copy_to(peer, body, arrays, taken)
            for body, arrays in parts:
                self._copy_to(peer, body, arrays, taken)

    def check(self, sl: Slice) -> None:
        """Refuse a request of a slice that has no working copy (see ``broken``)."""
        why = self.broken.get(sl.skey)
        if why is not None:
            raise BadRequest(why)

    def _copy_to(self, peer: int, body: dict, arrays: list, callback) -> None:
        """A copy that nothing waits for (a replica's catch-up): its failure is logged, and
        a slice a live replica refused has no working copy (``broken``) until one takes it."""
        skey = (body["k"], body["part"]) if body["op"] == "sync" else None

        def taken(reply: Message) -> None:
            if skey is not None:
                self.broken.pop(skey, None)
            callback(reply)

        fut = self.node.request(
            peer,
            Message(P.REPLICATE, body=body, arrays=arrays),
            callback=taken,
            what=f"{_about(body)} to {self.node.describe(peer)}",
        )

        def failed(exc: BaseException) -> None:
            if peer in getattr(self.node, "down", ()):  # (a dead one: said once, elsewhere)
                return
            if skey is None or not isinstance(exc, RequestError):
                # (not a refusal: a timeout or a closed node, which its death settles)
                log.warning("server: a replica did not take a copy: %s", exc)
                return
            me = self.node.describe(self.node.id)
            why = (
                f"key {skey[0]!r} part {skey[1]} has no working copy: {me} serves it and "
                f"{self.node.describe(peer)}, its replica, refused the copy ({exc}); a second "
                "death could lose it, so the job stops here"
            )
            if skey not in self.broken:
                log.error("server: %s", why)
            self.broken[skey] = why

        fut.errback = failed
        if fut.error is not None:
            failed(fut.error)

    def copy_in(self, msg: Message) -> None:
        """A primary's copy: the first value of a chunk of a key, or a finished round."""
        op = type(msg.typed).__struct_config__.tag  # (a member of commands.Replicate)
        if op != "round":  # (the rounds, most copies, go on below; the others by their op)
            take = {"init": self.server.init, "optimizer": self._optimizer_copy}
            take |= {"sync": self._sync_copy, "drop": self._moved_copy, "states": self._moved_copy}
            take |= dict.fromkeys(TABLE_OPS, self.server.tables.copies.copy_in)  # (a table's)
            take[op](msg)
            return
        b = msg.typed  # (op round: a ReplicaRound)
        key, part, rnd, mode = b.key, b.part, b.round, b.mode
        sl = self.slices.get((key, part))
        if sl is None:
            raise BadRequest(f"replicate: no copy of key {short(key)} part {short(part)} here")
        if (
            len(msg.arrays) != 1
            or msg.arrays[0].dtype != sl.value.dtype
            or (msg.arrays[0].size != sl.value.size)
        ):
            raise BadRequest(f"replicate: the round of key {key!r} does not fit its part")
        data = msg.arrays[0].reshape(-1)
        if sl.primary:
            # a late copy from a primary that died after we took its keys over: the round
            # was acknowledged to nobody (we never acknowledged the copy), so every push of
            # it comes here again and the round is made from them
            self.answers.reply(msg)
            return
        if rnd > sl.rounds + 1:
            raise BadRequest(
                f"replicate: round {rnd} of key {key!r} part {part}, but this copy has "
                f"{sl.rounds}: a round is missing"
            )
        if rnd > sl.rounds:  # (an earlier one again is only acknowledged)
            if mode == "grad":
                if self.server.optimizer is None:
                    raise BadRequest("replicate: a gradient round, but no optimizer is set here")
                self.server.aggregator.apply(sl, data, -1)
            else:
                writable(sl)
                sl.value = np.array(data)
            sl.rounds = rnd
            self.server.rounds += 1
        self.answers.reply(msg)

    def _optimizer_copy(self, msg: Message) -> None:
        """A primary's optimizer, for a replica that has none (one admitted again): unpickled
        from a server of this job (an authenticated connection, see hetps.cluster.allow)."""
        if self.server.optimizer is None:
            if len(msg.arrays) != 1:
                raise BadRequest("replicate: an optimizer copy carries one pickle")
            try:
                self.server.optimizer = optim.loads(msg.arrays[0].tobytes())
            except Exception as exc:  # noqa: BLE001 - unpickling can raise anything
                raise BadRequest(f"replicate: the optimizer did not load ({exc})") from None
            self.server.optimizer_blob = msg.arrays[0].tobytes()
        self.answers.reply(msg)

    def _sync_copy(self, msg: Message) -> None:
        """A whole slice from its primary: value, round count and optimizer state."""
        b = msg.typed  # (a ReplicaSync: its fields' types and bounds checked)
        key, part, shape, rnd = b.key, b.part, b.shape, b.round
        if len(msg.arrays) not in (1, 2) or msg.arrays[0].dtype != WIRE_DTYPES[b.dtype]:
            raise BadRequest("replicate: a malformed slice copy")
        sl = self.slices.get((key, part))
        if sl is not None and sl.primary:
            raise BadRequest(f"replicate: key {key!r} part {part} is served here, not a copy")
        value = np.array(msg.arrays[0]).reshape(-1)
        if sl is None or sl.value.size != value.size:
            sl = Slice(key, part, tuple(shape), value)
            self.slices[(key, part)] = sl
        else:
            writable(sl)
            sl.value = value
        if len(msg.arrays) == 2:
            states = _states(msg.arrays[1])
            sl.state, sl.has_state = states.get((key, part)), (key, part) in states
        else:
            sl.state, sl.has_state = None, False
        sl.rounds, sl.origin = rnd, msg.sender
        self.answers.reply(msg)

    def _moved_copy(self, msg: Message) -> None:
        """A plan moved slices (HETPS_BALANCE): ``drop``, the old primary's copies of them
        go; ``states``, the new primary's optimizer states of them. Only copies of the
        sender's are touched: a slice served here, or copied from another server, stays."""

        def mine(key: Any) -> Slice | None:
            sl = self.slices.get(key)
            return sl if sl is not None and not sl.primary and sl.origin == msg.sender else None

        if type(msg.typed).__struct_config__.tag == "drop":
            for item in msg.typed.slices:  # (a ReplicaDrop: [key, part] each)
                if mine((item[0], item[1])) is not None:
                    del self.slices[(item[0], item[1])]
        else:
            if len(msg.arrays) != 1:
                raise BadRequest("replicate: a states copy carries one pickle")
            for sk, st in _states(msg.arrays[0]).items():
                sl = mine(tuple(sk) if isinstance(sk, list) else sk)
                if sl is not None:
                    sl.state, sl.has_state = st, True
        self.answers.reply(msg)


def _states(blob: np.ndarray) -> dict:
    """A state copy's optimizer states (BadRequest where they do not load)."""
    try:
        return optim.load_states(blob.tobytes())
    except Exception as exc:  # noqa: BLE001 - unpickling can raise anything
        raise BadRequest(f"replicate: a state copy did not load ({exc})") from None


def _drop_item(item: Any) -> bool:
    """Whether ``item`` names a slice to drop: ``[key, part]``, or ``[key, part, to]`` with
    ``to`` the node id of the server it moved to."""
    return (
        isinstance(item, list)
        and len(item) in (2, 3)
        and slice_key(item[:2])
        and (len(item) == 2 or (isinstance(item[2], int) and not isinstance(item[2], bool)))
    )


def _about(body: dict) -> str:
    """A copy this server built, for its request's error text: its op, and its key if it has one."""
    return f"a copy ({body['op']})" + (f" of key {body['k']!r}" if "k" in body else "")
