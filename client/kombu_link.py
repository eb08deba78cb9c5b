"""The kombu transport's hold on the cluster: one `AsyncClient` on a loop thread of its own.

kombu calls a transport from the threads of its application (Celery's consumer loop, its
pool's threads, a producer's request handlers); the client library is asyncio. `ClusterLink`
runs one `AsyncClient` on a private event loop in a daemon thread, as `client/sync.py` does,
and offers the two ways the transport needs: `call` (run a coroutine there and wait for it:
publish, declare, size) and `spawn` (start one and be told when it ends: the long polls and
the lease keep-alive, which must not hold up kombu's thread). Errors leave here as kombu's
own exception classes (`ClusterConnectionError`, `ClusterChannelError`) so that kombu and
Celery know what to retry: see `kombu_error` and docs/CELERY.md, "Failures".

`broker_url` parsing lives here too: `qcluster://host1:7100,host2:7100,host3:7100`, the first
node that answers becomes the client's node and the client library learns the others from the
cluster map (client/router.py).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

from kombu.exceptions import ChannelError as KombuChannelError
from kombu.exceptions import ConnectionError as KombuConnectionError

from client.aio import AsyncClient
from client.credentials import Credentials, load_credentials
from client.sync import loop_thread
from wire.errors import E_UNAUTHENTICATED, QueueError

LINK_THREAD_NAME = "qcluster-kombu-loop"     # each link's event loop thread (one per kombu connection)

T = TypeVar("T")
SCHEMES = ("qcluster://",)
DEFAULT_PORT = 7100
# How long a blocking call waits for its answer beyond the client library's own deadline
# (request_timeout_s, during which it retries a failover away): a loop that does not answer
# at all is a broken connection, not a slow one.
CALL_MARGIN_S = 5.0
# The client's own node unreachable this long: the transport reports the connection lost, so
# that kombu connects again through another node. The client library follows a queue to its
# new master when its node is down, but it stays with a node that is a member of the queue's
# pair (client/router.py), which a failed master still is until it is replaced.
NODE_DOWN_S = 2.0
NODE_WATCH_S = 0.2


class ClusterConnectionError(KombuConnectionError):
    """The cluster could not be reached, or kept failing past the client library's deadline
    (its retries hide a handoff or a failover): kombu reconnects, Celery retries the publish."""

    def __init__(self, message: str, code: str = "E_UNAVAILABLE") -> None:
        super().__init__(message)
        self.code = code


class ClusterChannelError(KombuChannelError):
    """The cluster refused the operation (a missing grant, an unknown queue, bad input):
    retrying it would meet the same refusal. `code` is the stable E_* code."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def kombu_error(error: QueueError, doing: str) -> KombuConnectionError | KombuChannelError:
    """A client library error as the exception kombu expects: a retriable one the library
    could not hide is a lost connection (kombu reconnects), anything else a channel error."""
    text = f"{doing}: {error}"
    if error.retriable or error.code == "E_TIMEOUT":
        return ClusterConnectionError(text, error.code)
    return ClusterChannelError(text, error.code)


def node_urls(hostname: str | None, *, tls: bool = False, port: int = DEFAULT_PORT) -> list[str]:
    """The node URLs of a broker URL: `qcluster://h1:7100,h2:7100` -> ['http://h1:7100', ...].
    A host may carry its own `http://`/`https://`; without a port it gets `port`; `tls` (kombu's
    `ssl`, Celery's `broker_use_ssl`) makes bare hosts `https`. An empty list: no hosts named."""
    text = (hostname or "").strip()
    for scheme in SCHEMES:
        if text.startswith(scheme):
            text = text[len(scheme):]
            break
    # A path or query after the hosts names nothing here (virtual hosts do not exist in the cluster).
    for separator in ("/", "?"):
        if separator in text and "://" not in text:
            text = text.split(separator, 1)[0]
    urls = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if "://" in part:
            urls.append(part.rstrip("/"))
            continue
        host = part.rsplit("@", 1)[-1]        # user:password@ means nothing: the credentials file signs
        if not host.startswith("[") and host.count(":") == 1 or host.startswith("[") and "]:" in host:
            with_port = host
        else:
            with_port = f"{host}:{port}"
        urls.append(f"{'https' if tls else 'http'}://{with_port}")
    return urls


class ClusterLink:
    """One AsyncClient on its own loop thread, connected to the first node of `urls` that
    answers (`connect`); `call` and `spawn` run coroutines there."""

    def __init__(self, urls: list[str], credentials: Credentials | str | None, *,
                 request_timeout_s: float = 30.0, connect_timeout_s: float = 5.0) -> None:
        self.credentials = credentials if isinstance(credentials, Credentials) else load_credentials(credentials)
        self.urls = urls or [self.credentials.url]
        self.request_timeout_s = request_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.client: AsyncClient | None = None
        self.url: str | None = None
        self.learned_urls: list[str] = []     # every node of the cluster map, read at connect
        self._down_since: float | None = None
        self._watch: concurrent.futures.Future[None] | None = None
        self._loop, self._thread = loop_thread(LINK_THREAD_NAME)
        self._closed = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def connect(self) -> None:
        """Connect to the first node that answers, in the order of the broker URL. Raises
        ClusterConnectionError naming every node tried when none does; ClusterChannelError
        when a node refuses the credentials (another cluster's file: retrying cannot help)."""
        failures = []
        for url in self.urls:
            client = self._run(self._make_client(url), self.connect_timeout_s + CALL_MARGIN_S)
            try:
                self._run(asyncio.wait_for(client.connect(), self.connect_timeout_s),
                          self.connect_timeout_s + CALL_MARGIN_S)
            except (QueueError, OSError, TimeoutError) as error:
                self._run(client.close(), CALL_MARGIN_S)
                if isinstance(error, QueueError) and error.code == E_UNAUTHENTICATED.code:
                    raise ClusterChannelError(f"{url} refused the credentials of client "
                                              f"{self.credentials.client_id!r}: {error}", error.code) from None
                failures.append(f"{url}: {error}")
                continue
            self.client, self.url = client, url
            # Learn every node now: should this one die, the client library reads the map at
            # another and follows each queue to its new master (client/router.py), where a
            # client that knew only this node would wait out its request deadline.
            try:
                self._run(client.refresh_placement(), self.connect_timeout_s + CALL_MARGIN_S)
                cluster = self._run(client.cluster(), self.connect_timeout_s + CALL_MARGIN_S)
                self.learned_urls = [str(node["url"]).rstrip("/") for node in cluster.get("nodes", [])
                                     if isinstance(node, dict) and node.get("url")]
            except (QueueError, ClusterConnectionError, TypeError, ValueError):
                pass
            self._watch = asyncio.run_coroutine_threadsafe(self._watch_node(client), self._loop)
            return
        raise ClusterConnectionError("no node of the cluster answers (" + "; ".join(failures) + ")")

    async def _make_client(self, url: str) -> AsyncClient:
        # Made on the loop: the client binds to the loop that first uses it.
        return AsyncClient(url, self.credentials, request_timeout_s=self.request_timeout_s,
                           connect_timeout_s=self.connect_timeout_s)

    def _run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float) -> T:
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise ClusterConnectionError(f"no answer from the client library in {timeout_s:g} s",
                                         "E_TIMEOUT") from None

    async def _watch_node(self, client: AsyncClient) -> None:
        """Note since when the client's own node has been unreachable (its WebSocket down)."""
        while True:
            if client.connected:
                self._down_since = None
            elif self._down_since is None:
                self._down_since = self._loop.time()
            await asyncio.sleep(NODE_WATCH_S)

    def check_node(self) -> None:
        """Raise ClusterConnectionError once the client's node has been down NODE_DOWN_S."""
        since = self._down_since
        if since is not None and self._loop.time() - since >= NODE_DOWN_S:
            raise ClusterConnectionError(f"{self.url} has not answered for {NODE_DOWN_S:g} s: connecting "
                                         "again through another node")

    def call(self, make: Callable[[AsyncClient], Coroutine[Any, Any, T]], doing: str,
             timeout_s: float | None = None) -> T:
        """`make(client)` run on the loop, waited for; a QueueError leaves as a kombu error."""
        client = self._connected()
        self.check_node()
        try:
            return self._run(make(client), (timeout_s or self.request_timeout_s) + CALL_MARGIN_S)
        except QueueError as error:
            raise kombu_error(error, doing) from error

    def spawn(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start `coroutine` on the loop without waiting for it."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def _connected(self) -> AsyncClient:
        if self.client is None or self._closed:
            raise ClusterConnectionError("the transport is not connected")
        return self.client

    @property
    def node_down(self) -> bool:
        """The client's node is unreachable now (its WebSocket is down)."""
        return self._down_since is not None

    @property
    def usable(self) -> bool:
        return self.client is not None and not self._closed and self.client.usable

    def close(self, cleanup: Callable[[AsyncClient], Coroutine[Any, Any, None]] | None = None,
              timeout_s: float = 5.0) -> None:
        """Run `cleanup` (bounded by `timeout_s`), close the client and stop the thread; twice is a no-op."""
        if self._closed:
            return
        self._closed = True
        client = self.client
        if self._watch is not None:
            self._watch.cancel()

        async def finish() -> None:
            if client is not None:
                if cleanup is not None:
                    try:
                        await asyncio.wait_for(cleanup(client), timeout_s)
                    except (QueueError, OSError, TimeoutError):
                        pass      # best effort: what it would give back, its leases' timeouts give back
                # What still runs (a long poll, the keep-alive) ends here, not with the loop.
                others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
                for task in others:
                    task.cancel()
                await asyncio.gather(*others, return_exceptions=True)
                await client.close()
        try:
            asyncio.run_coroutine_threadsafe(finish(), self._loop).result(timeout_s + CALL_MARGIN_S)
        except (concurrent.futures.TimeoutError, QueueError, OSError):
            pass
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if threading.current_thread() is not self._thread:
                self._thread.join(CALL_MARGIN_S)


def options_of(transport_options: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The transport options this transport knows, with their defaults. A value of the wrong
    type is refused at connect; other names pass, since kombu's and Celery's own options
    (e.g. `max_retries`) share the mapping."""
    known = dict(defaults)
    for name, value in transport_options.items():
        if name not in known:
            continue      # kombu's and Celery's own options (e.g. max_retries) share this mapping
        default = defaults[name]
        if default is not None and not isinstance(value, type(default)) \
                and not (isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool)):
            raise ValueError(f"transport option {name!r} must be {type(default).__name__}, not {value!r}")
        known[name] = value
    return known
