"""`Router`: the client library's copy of the cluster map and one connection per node.

It answers "which node's connection carries this queue's traffic" (`route`), reads the map
again when a node says the queue is not its own (E_NOT_MASTER) or cannot be reached
(`rerouted`, waiting through a failover within the membership layer's lease, docs/RAFT.md),
shares one reading between every call that needs one (`refresh_placement`), and watches
enqueues at a master that stopped answering (`hedged`, `watched`: the same dedupe ids asked
again where the map names the master now). Kept apart from the connection (client/connection.py,
one socket, no map) and from the facade (client/aio.py, the application's calls), so that what
follows the map is in one place; client/channels.py and client/macro.py use it through the
small interface named without underscores (`route`, `consume_target`, `knows_master`,
`channel_class`, `refresh_placement`, `closed`).
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any

from client.connection import Leases, NodeConnection, ignore_outcome
from client.credentials import Credentials
from client.http import HttpClient
from replication.options import DEAD_LETTER_SUFFIX
from wire.errors import E_INTERNAL, E_NOT_MASTER, E_QUEUE_UNAVAILABLE, E_UNAVAILABLE, QueueError

ROUTED_ENQUEUE_RETRY_S = 0.5   # see Router.node_connection
FAILOVER_WAIT_S = 4.0          # how long a call waits for the map to name a reachable master
FAILOVER_POLL_S = 0.1
STALL_CHECK_S = 0.25           # an enqueue unanswered this long reads the map again (Router.hedged)
WATCH_SWEEP_S = STALL_CHECK_S / 4   # how often the watched enqueues are looked over (_sweep_watches)
MAP_READ_TIMEOUT_S = 0.3       # a node's copy of the map not read in this long is passed over
PLACEMENT_QUEUES_MAX = 100     # queue entries one reading asks for; more: the whole map (PROTOCOL.md)
# Set while a call is retried after a failure (retried_once): a retry at this very node
# (it has just become the queue's master) is taken once per call, not again from the retry.
_RETRYING: contextvars.ContextVar[bool] = contextvars.ContextVar("qcluster_retrying", default=False)

# One attempt of a call at one node's connection.
Attempt = Callable[[NodeConnection], Coroutine[Any, Any, Any]]


def first_failure(first: BaseException | None, then: BaseException) -> BaseException:
    """The failure to report for a call tried more than once: the first one, but with its
    outcome unknown when any attempt's was (that attempt may have been applied)."""
    if first is None:
        return then
    if isinstance(first, QueueError) and not first.outcome_unknown \
            and isinstance(then, QueueError) and then.outcome_unknown:
        return QueueError(first.kind, first.message, outcome_unknown=True)
    return first


async def retried_once(first: QueueError, retry: Awaitable[Any]) -> Any:
    """The one retry of a call whose first attempt failed with `first`: when that attempt's
    outcome was unknown, a definite error of the retry does not make the call's outcome
    definite (the first attempt may have been applied)."""
    retrying = _RETRYING.set(True)
    try:
        return await retry
    except QueueError as error:
        if first.outcome_unknown and not error.outcome_unknown:
            raise QueueError(error.kind, error.message, outcome_unknown=True) from error
        raise
    finally:
        _RETRYING.reset(retrying)


class _PlacementReading:
    """One reading of the map (refresh_placement): the queues its callers asked about, or the
    whole map."""

    __slots__ = ("names", "task", "whole")

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.whole = False
        self.task: asyncio.Task[None]


class _Watch:
    """One enqueue watched without a task of its own (Router.watched): its attempts, the first
    a future in its node's open batch, any later one a task started by the router's sweep
    where the map names the master now; `outcome` takes the first answer."""

    __slots__ = ("asked", "asked_at", "attempt", "failure", "outcome", "pending", "queue", "tasks")

    def __init__(self, queue: str, attempt: Attempt, target: NodeConnection,
                 outcome: asyncio.Future[Any], asked_at: float) -> None:
        self.queue = queue
        self.attempt = attempt
        self.asked = {target}
        self.asked_at = asked_at
        self.outcome = outcome
        self.pending = 1
        self.failure: BaseException | None = None
        self.tasks: list[asyncio.Task[Any]] = []

    def settle(self, attempt: asyncio.Future[Any]) -> None:
        """An attempt ended: its answer wins; a failure counts only once every attempt failed."""
        self.pending -= 1
        error = QueueError(E_UNAVAILABLE, "the attempt was cancelled", outcome_unknown=True) \
            if attempt.cancelled() else attempt.exception()       # read even when it comes too late
        if self.outcome.done():
            return
        if error is None:
            self.outcome.set_result(attempt.result())
        else:
            self.failure = first_failure(self.failure, error)
        if not self.outcome.done() and self.pending == 0:
            self.outcome.set_exception(self.failure)      # type: ignore[arg-type]
        if self.outcome.done():
            for task in self.tasks:
                task.cancel()


class Router:
    """The cluster map as this client last read it, and the connection of each node: the one
    the client was given (`home`) and one per other node, made when traffic first goes there."""

    def __init__(self, url: str, credentials: Credentials, limits: Mapping[str, Any],
                 learn_macros: Callable[[Mapping[str, Any], tuple[str, ...] | None], None]) -> None:
        """`limits`: NodeConnection's keyword arguments; `learn_macros`: told the macro queues'
        definitions of each reading (all of them, or only those of the queues it asked about)."""
        self._credentials = credentials
        self._limits = dict(limits)
        self._learn_macros = learn_macros
        # (queue, forward) -> what to call with the rate a root sends (forward sessions; shared
        # by every node's connection, wherever the sessions are).
        self.forward_rates: dict[tuple[str, str], Callable[[float | None], None]] = {}
        self.home = NodeConnection(url, credentials, **self._limits, forward_rates=self.forward_rates)
        self.url = self.home.url
        # The cluster map (docs/PROTOCOL.md): each queue's master, learned when a node answers
        # E_NOT_MASTER; traffic for a queue goes to the connection of its master's node.
        self._masters: dict[str, str] = {}        # queue -> the node to send its traffic to
        self._cluster_size = 0                     # nodes in the map when last read
        self._node_urls: list[str] = []            # the other nodes' URLs in it
        self._master_urls: dict[str, str] = {}    # queue -> its master's node
        self.has_map = False                       # a reading has named a master (until then: all to home)
        self._channel_classes: dict[str, str] = {}
        self.feature_level = 1        # the cluster's, as the newest map read said (wire/versions.py FEATURES)
        self._others: dict[str, NodeConnection] = {}
        self._closed = False
        # See refresh_placement: the reading that still takes names, and the last one begun.
        self._gathering: _PlacementReading | None = None
        self._last_reading: asyncio.Task[None] | None = None
        self._watches: deque[_Watch] = deque()                         # see watched
        self._watch_timer: asyncio.TimerHandle | None = None
        self._watch_sweep: asyncio.Task[None] | None = None

    @property
    def closed(self) -> bool:
        return self._closed

    async def close(self) -> None:
        """Close the home connection, then every other node's."""
        await self.home.close()
        self._closed = True
        if self._watch_timer is not None:
            self._watch_timer.cancel()
        for other in self._others.values():
            await other.close()

    # --- which connection -------------------------------------------------------------------
    def route(self, queue: str) -> NodeConnection:
        """The connection to the queue's master (`home` unless the map says otherwise)."""
        url = self._masters.get(queue)
        if url is None or url == self.url:
            return self.home
        return self.route_to(url)

    def route_to(self, url: str) -> NodeConnection:
        if url == self.url:
            return self.home
        other = self._others.get(url)
        if other is None:
            other = self._others[url] = self.node_connection(url)
        return other

    def node_connection(self, url: str) -> NodeConnection:
        """A connection to another node of the cluster. It gives up on an unreachable node
        soon (the router then asks the map where the queue went) instead of retrying for long."""
        limits: dict[str, Any] = {**self._limits, "enqueue_retry_time_s": min(
            float(self._limits["enqueue_retry_time_s"]), ROUTED_ENQUEUE_RETRY_S)}
        return NodeConnection(url, self._credentials, **limits, forward_rates=self.forward_rates)

    def consume_target(self, queue: str) -> NodeConnection:
        """Subscriptions go to the master (under `full` only it pushes)."""
        master = self._master_urls.get(queue)
        return self.route_to(master) if master is not None else self.home

    def knows_master(self, queue: str) -> bool:
        return queue in self._master_urls

    def channel_class(self, channel: str) -> str:
        """A channel's delivery class as the last whole reading of the map said (default `latest`)."""
        return self._channel_classes.get(channel, "latest")

    def http_for(self, queue: str) -> HttpClient:
        """The REST client of the queue's master's node."""
        return self.route(queue).http

    # --- reading the map ----------------------------------------------------------------------
    async def refresh_placement(self, queue: str | None = None) -> None:
        """Read the cluster map from every node (each lists the queues it holds); with `queue`,
        only that queue's entry (a map of thousands of queues is megabytes). Callers at once
        share one reading: after a failover thousands of calls in flight fail together, on
        one queue or on thousands, and read the map once, not once each against every node.
        A reading takes the names of every caller until it begins, and begins once the one
        before it has ended (so what made a caller ask is in what it reads); it asks for the
        names it took, PLACEMENT_QUEUES_MAX to a request (2,000 queues' entries are 20 small
        requests to each node, where the whole map of 10,000 is 5.6 MB from each), or for the
        whole map if a caller wanted it."""
        reading = self._gathering
        if reading is None:
            reading = self._gathering = _PlacementReading()
            reading.task = self.home.bound_loop().create_task(self._read_when_due(reading, self._last_reading))
            reading.task.add_done_callback(ignore_outcome)
            self._last_reading = reading.task
        if queue is None:
            reading.whole = True
        else:
            reading.names.add(queue.removesuffix(DEAD_LETTER_SUFFIX))     # it lives in its queue's entry
        await asyncio.shield(reading.task)

    async def _read_when_due(self, reading: _PlacementReading, before: asyncio.Task[None] | None) -> None:
        if before is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(before)
        else:
            await asyncio.sleep(0)      # callers of this same turn join
        if self._gathering is reading:
            self._gathering = None
        if reading.whole:
            await self._read_placement(None)
            return
        names = sorted(reading.names)
        await asyncio.gather(*(self._read_placement(tuple(names[start:start + PLACEMENT_QUEUES_MAX]))
                               for start in range(0, len(names), PLACEMENT_QUEUES_MAX)))

    async def _read_placement(self, scope: tuple[str, ...] | None) -> None:
        first = await self._map_at(self.home, scope)
        home_answers = first is not None
        if first is None:
            # This client's own node is down or paused: any other node of the last map knows it.
            first = await self._cluster_from_another_node(scope)
        urls = {node["id"]: node["url"].rstrip("/") for node in first.get("nodes", [])}
        self._cluster_size = len(urls)
        self._node_urls = [url for url in urls.values() if url != self.url]
        # Every node at once, each within MAP_READ_TIMEOUT_S: a paused node answers nothing and
        # must not hold up learning that its queues failed over (a peer link's state says
        # nothing of ours, so each node is asked).
        others = await asyncio.gather(*(self._map_at(self.route_to(url), scope) for url in self._node_urls))
        maps = [first] + [cluster_map for cluster_map in others if cluster_map is not None]
        newest_map = max(maps, key=lambda cluster_map: cluster_map.get("version", 0))
        self.feature_level = int(newest_map.get("feature_level", 1))
        if scope is None:
            self._learn_macros(newest_map.get("macros", {}), None)
            self._channel_classes = {name: channel.get("class", "latest")
                                     for name, channel in newest_map.get("channels", {}).items()}
        else:       # only what was asked about is known to be there (or gone)
            self._learn_macros(newest_map.get("macros", {}), scope)
        newest: dict[str, dict[str, Any]] = {}
        for cluster_map in maps:        # nodes may lag behind the membership layer: newest epoch wins
            for queue, pair in cluster_map.get("queues", {}).items():
                if pair.get("epoch", 0) >= newest.get(queue, {}).get("epoch", 0):
                    newest[queue] = pair
        for queue, pair in newest.items():
            if pair.get("master") not in urls:
                continue
            # A client of either member stays with it (under `producer` each member serves
            # its own consumers; a replica forwards what its master must order), while it
            # answers: a client whose node is down goes to the master, not to the replica the
            # map still lists its dead node as after a failover (it would wait out its deadline).
            members = {urls[pair["master"]], urls.get(pair.get("replica") or "", "")}
            stays_home = home_answers and self.url in members
            # A queue's dead-letter queue lives in its pair (the map has no entry of its own).
            for name in (queue, queue + DEAD_LETTER_SUFFIX):
                self._masters[name] = self.url if stays_home else urls[pair["master"]]
                self._master_urls[name] = urls[pair["master"]]
            self.has_map = True

    async def _cluster_from_another_node(self, scope: tuple[str, ...] | None = None) -> dict[str, Any]:
        for url in self._node_urls:
            cluster_map = await self._map_at(self.route_to(url), scope)
            if cluster_map is not None:
                return cluster_map
        raise QueueError(E_UNAVAILABLE, f"{self.url} did not answer and no other node of the map did")

    @staticmethod
    async def _map_at(node: NodeConnection, scope: tuple[str, ...] | None = None) -> dict[str, Any] | None:
        """A node's copy of the cluster map (only the entries of the queues in `scope`, if
        given), or None if it does not answer in MAP_READ_TIMEOUT_S."""
        try:
            async with asyncio.timeout(MAP_READ_TIMEOUT_S):
                return await node.http.cluster(scope)
        except (QueueError, TimeoutError):
            return None

    # --- following the queue after a failure --------------------------------------------------
    async def rerouted(self, queue: str, error: QueueError, failed: NodeConnection) -> NodeConnection | None:
        """After E_NOT_MASTER (or the queue's node `failed` being unreachable): the master's
        connection, if the refreshed map names another node than the one that failed."""
        if error.code not in (E_NOT_MASTER.code, E_UNAVAILABLE.code, E_QUEUE_UNAVAILABLE.code):
            return None
        loop = asyncio.get_running_loop()
        started = loop.time()
        while True:
            try:
                await self.refresh_placement(queue)
            except QueueError:
                return None
            # Only a cluster fails over: a lone node that is down stays down until it returns.
            waits = error.code != E_NOT_MASTER.code and self._cluster_size > 1
            deadline = started + (FAILOVER_WAIT_S if waits else 0.0)
            target = self.route(queue)
            if error.code == E_NOT_MASTER.code:
                break
            # The node asked is there (its socket is up) but could not serve for a moment: it
            # waits for its lease, or lost its link to the master it forwards to.
            if target is not failed or error.code == E_QUEUE_UNAVAILABLE.code or failed.connected:
                if target is failed:
                    await asyncio.sleep(FAILOVER_POLL_S)
                return target
            if loop.time() >= deadline:
                return None
            # The queue's node is unreachable and the map still names it: the membership
            # layer fails over within its lease (docs/RAFT.md); ask again shortly.
            await asyncio.sleep(FAILOVER_POLL_S)
        if target is self.home:
            master = self._master_urls.get(queue)
            if master == self.url:
                # This node has just become the master: what it took as replica and forwarded
                # failed ("this member became the master"); once more, here.
                return None if _RETRYING.get() else self.home
            # This node is a member but did not hold the queue yet (it has just been created):
            # this once, the master answers.
            if master is None:
                return None
            target = self.route_to(master)
        # The node that has just refused is asked again once per call, never from its retry.
        return None if target is failed and _RETRYING.get() else target

    # --- a leased message's calls (client/consumer.py Message) ---------------------------------
    def leases_for(self, node: NodeConnection) -> Leases:
        """Who acks, releases and extends a message leased at `node`: that node, or for one
        leased at the home node, this router (which sends the call where the map says now)."""
        return self if node is self.home else node

    def ack(self, queue: str, message_id: int, receipt: str) -> Awaitable[None]:
        return self.route(queue).ack(queue, message_id, receipt)

    async def release(self, queue: str, message_id: int, receipt: str) -> None:
        target = self.route(queue)
        if target is self.home:
            return await target.release(queue, message_id, receipt)
        return await self.via(queue, target, lambda node: node.release(queue, message_id, receipt))

    async def extend(self, queue: str, message_id: int, receipt: str, visibility_timeout_s: float) -> None:
        target = self.route(queue)
        if target is self.home:
            return await target.extend(queue, message_id, receipt, visibility_timeout_s)
        return await self.via(queue, target,
                              lambda node: node.extend(queue, message_id, receipt, visibility_timeout_s))

    async def via(self, queue: str, target: NodeConnection, attempt: Attempt) -> Any:
        """`attempt` at the queue's node `target`; when that node fails (unreachable, or no
        longer the master), refresh the map and try the node it names now, once."""
        try:
            return await attempt(target)
        except QueueError as error:
            other = await self.rerouted(queue, error, failed=target)
            if other is None:
                raise
            # Once more, where the map says now (the same node too: it has just become the
            # master, so what it forwarded before failed).
            return await retried_once(error, attempt(other))

    async def hedged(self, queue: str, attempt: Attempt) -> Any:
        """An enqueue at the queue's master, watched: while it is unanswered, every
        STALL_CHECK_S the map is read again (one reading shared by every waiting call), and
        when it names another master (the one asked paused or was cut off, and its replica
        took over), the same enqueue, with the same dedupe ids, is asked there too. The first
        answer wins; the dedupe ids store the message once whichever attempts got through.
        Without it, calls sent to a paused master waited for their deadline although the
        replica was promoted seconds before."""
        loop = self.home.bound_loop()
        target = self.route(queue)
        asked = {target}
        attempts = {loop.create_task(attempt(target))}
        failure: BaseException | None = None
        try:
            while attempts:
                done, attempts = await asyncio.wait(attempts, timeout=STALL_CHECK_S,
                                                    return_when=asyncio.FIRST_COMPLETED)
                for finished in done:
                    error = finished.exception()
                    if error is None:
                        return finished.result()
                    failure = first_failure(failure, error)
                if done or not attempts:
                    continue
                with contextlib.suppress(QueueError):
                    await self.refresh_placement(queue)
                target = self.route(queue)
                if target not in asked:
                    asked.add(target)
                    attempts.add(loop.create_task(attempt(target)))
            if isinstance(failure, QueueError) and target is not self.home:
                # Every attempt failed, the last at another node: as any routed call, refresh
                # the map (waiting for a failover while the node is unreachable) and try where
                # it says now, once. (Attempts at the home node reroute themselves.)
                other = await self.rerouted(queue, failure, failed=target)
                if other is not None:
                    return await retried_once(failure, attempt(other))
            raise failure or QueueError(E_INTERNAL, "no attempt was made")
        finally:
            for pending in attempts:
                pending.cancel()
                pending.add_done_callback(ignore_outcome)

    async def watched(self, queue: str, target: NodeConnection, first: asyncio.Future[Any], attempt: Attempt) -> Any:
        """An enqueue at the queue's master, watched as `hedged` watches a call, but without a
        task and a timed wait per call (they cost a map-aware client about a quarter of its
        throughput: bench/RESULTS.md): `first` already joined `target`'s batch, and a sweep of
        the watched calls every WATCH_SWEEP_S asks again, where the map names the master now,
        those unanswered for that long."""
        loop = self.home.bound_loop()
        watch = _Watch(queue, attempt, target, loop.create_future(), loop.time())
        first.add_done_callback(watch.settle)
        self._watches.append(watch)
        if self._watch_timer is None:
            self._watch_timer = loop.call_later(WATCH_SWEEP_S, self._sweep_watches)
        try:
            return await watch.outcome
        except QueueError as failure:
            # Every attempt failed, the last one at its node: as a routed call, read the map
            # (waiting through a failover) and try once where it says now.
            other = await self.rerouted(queue, failure, failed=target)
            if other is None:
                raise
            return await retried_once(failure, attempt(other))

    def _sweep_watches(self) -> None:
        """Every WATCH_SWEEP_S while enqueues are watched: drop the answered ones; if some
        waited STALL_CHECK_S, read the map (one reading for all) and ask each of them again at
        the master it names now, if that is a node not asked yet."""
        self._watch_timer = None
        loop = self.home.bound_loop()
        now = loop.time()
        watches = self._watches = deque(w for w in self._watches if not w.outcome.done())
        if any(now - w.asked_at >= STALL_CHECK_S for w in watches) and \
                (self._watch_sweep is None or self._watch_sweep.done()):
            self._watch_sweep = loop.create_task(self._ask_stalled_again())
            self._watch_sweep.add_done_callback(ignore_outcome)
        if watches and not self.home.closed:
            self._watch_timer = loop.call_later(WATCH_SWEEP_S, self._sweep_watches)

    async def _ask_stalled_again(self) -> None:
        # Only the stalled queues' entries (one shared reading): the whole map of 10,000 queues
        # is 5.6 MB that each node encodes on its loop, the membership leader's too, while it
        # should be failing those queues over (issue 31).
        loop = self.home.bound_loop()
        now = loop.time()
        stalled = {watch.queue for watch in self._watches
                   if not watch.outcome.done() and now - watch.asked_at >= STALL_CHECK_S}
        with contextlib.suppress(QueueError):
            await asyncio.gather(*(self.refresh_placement(queue) for queue in stalled))
        now = loop.time()
        for watch in self._watches:
            if watch.outcome.done() or now - watch.asked_at < STALL_CHECK_S:
                continue
            target = self.route(watch.queue)
            if target in watch.asked:
                continue
            watch.asked.add(target)
            watch.asked_at, watch.pending = now, watch.pending + 1
            task = loop.create_task(watch.attempt(target))
            watch.tasks.append(task)
            task.add_done_callback(watch.settle)
