"""The Toxiproxy-compatible server (chaos/toxiproxy_server.py), driven by the real
`toxiproxy-python` client against an echo upstream, over real sockets on 127.0.0.1.

toxiproxy-python is synchronous and keeps the server address on a class attribute, so these
are plain synchronous tests; the server runs on its own event loop in a background thread.
"""
from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests
from toxiproxy import Toxiproxy
from toxiproxy.api import APIConsumer
from toxiproxy.exceptions import InvalidToxic, NotFound, ProxyExists

from chaos.toxiproxy_server import ToxiproxyHandle, start

pytestmark = pytest.mark.timeout(30)

SOCKET_TIMEOUT_S = 5.0


class EchoHandler(socketserver.BaseRequestHandler):
    """Echoes what it reads; closes its side after echoing anything containing b"BYE"."""

    def handle(self) -> None:
        self.request.settimeout(20)
        try:
            while data := self.request.recv(65536):
                self.request.sendall(data)
                if b"BYE" in data:
                    return
        except OSError:
            return


class EchoServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


@pytest.fixture(scope="module")
def echo_port() -> Iterator[int]:
    server = EchoServer(("127.0.0.1", 0), EchoHandler)
    thread = threading.Thread(target=server.serve_forever, name="echo", daemon=True)
    thread.start()
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()
    thread.join(5)


@pytest.fixture(scope="module")
def server() -> Iterator[ToxiproxyHandle]:
    with start(backend="thread", seed=7) as handle:
        yield handle


@pytest.fixture
def toxiproxy(server: ToxiproxyHandle) -> Iterator[Toxiproxy]:
    client = server.client()
    yield client
    client.destroy_all()


def make_proxy(toxiproxy: Toxiproxy, echo_port: int, name: str = "echo") -> Any:
    return toxiproxy.create(upstream=f"127.0.0.1:{echo_port}", name=name)


def port_of(proxy: Any) -> int:
    return int(proxy.listen.rsplit(":", 1)[1])


def connect(proxy: Any) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port_of(proxy)), timeout=SOCKET_TIMEOUT_S)


def receive_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        piece = sock.recv(size - len(data))
        if not piece:
            break
        data += piece
    return data


def round_trip_s(sock: socket.socket, payload: bytes = b"ping") -> float:
    started = time.monotonic()
    sock.sendall(payload)
    assert receive_exactly(sock, len(payload)) == payload
    return time.monotonic() - started


def read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while piece := sock.recv(65536):
        data += piece
    return data


def api(server: ToxiproxyHandle, method: str, path: str, **kwargs: Any) -> requests.Response:
    return requests.request(method, server.url + path, timeout=SOCKET_TIMEOUT_S, **kwargs)


# --- The API ------------------------------------------------------------------------------


def test_version_answers_with_a_json_version(toxiproxy: Toxiproxy) -> None:
    assert toxiproxy.running()
    assert b'"version"' in toxiproxy.version()


def test_a_created_proxy_is_listed_fetched_and_destroyed(toxiproxy: Toxiproxy, echo_port: int,
                                                         server: ToxiproxyHandle) -> None:
    proxy = make_proxy(toxiproxy, echo_port)
    assert proxy.enabled is True
    assert proxy.listen.startswith("127.0.0.1:") and port_of(proxy) > 0
    assert set(toxiproxy.proxies()) == {"echo"}
    shown = api(server, "GET", "/proxies/echo").json()
    assert shown == {"name": "echo", "listen": proxy.listen, "upstream": f"127.0.0.1:{echo_port}",
                     "enabled": True, "toxics": []}
    assert toxiproxy.get_proxy("echo").upstream == f"127.0.0.1:{echo_port}"
    assert proxy.destroy()
    assert toxiproxy.proxies() == {}
    with pytest.raises(NotFound):
        proxy.destroy()


def test_creating_an_existing_proxy_is_a_conflict(toxiproxy: Toxiproxy, echo_port: int,
                                                  server: ToxiproxyHandle) -> None:
    make_proxy(toxiproxy, echo_port)
    with pytest.raises(ProxyExists):
        APIConsumer.post("/proxies", json={"name": "echo", "upstream": f"127.0.0.1:{echo_port}"})
    answer = api(server, "POST", "/proxies", json={"name": "echo", "upstream": f"127.0.0.1:{echo_port}"})
    assert (answer.status_code, answer.json()) == (409, {"error": "proxy already exists", "status": 409})


def test_unknown_proxies_and_toxics_are_not_found(toxiproxy: Toxiproxy, echo_port: int,
                                                  server: ToxiproxyHandle) -> None:
    answer = api(server, "GET", "/proxies/nope")
    assert (answer.status_code, answer.json()) == (404, {"error": "proxy not found", "status": 404})
    with pytest.raises(NotFound):
        APIConsumer.post("/proxies/nope/toxics", json={"type": "latency"})
    proxy = make_proxy(toxiproxy, echo_port)
    with pytest.raises(NotFound):
        proxy.destroy_toxic("nope")
    answer = api(server, "GET", "/proxies/echo/toxics/nope")
    assert (answer.status_code, answer.json()) == (404, {"error": "toxic not found", "status": 404})


def test_bad_input_is_refused_with_400_and_duplicate_toxics_with_409(toxiproxy: Toxiproxy, echo_port: int,
                                                                     server: ToxiproxyHandle) -> None:
    proxy = make_proxy(toxiproxy, echo_port)
    with pytest.raises(InvalidToxic):
        proxy.add_toxic(type="no_such_toxic")
    with pytest.raises(InvalidToxic):
        proxy.add_toxic(type="latency", stream="sideways")
    with pytest.raises(InvalidToxic):
        proxy.add_toxic(type="latency", toxicity=2)
    with pytest.raises(InvalidToxic):
        proxy.add_toxic(type="latency", attributes={"latency": "slow"})
    proxy.add_toxic(type="latency", attributes={"latency": 10})
    with pytest.raises(ProxyExists):  # the client's name for any 409
        proxy.add_toxic(type="latency", attributes={"latency": 20})
    answer = api(server, "POST", "/proxies/echo/toxics", json={"type": "bogus"})
    assert (answer.status_code, answer.json()) == (400, {"error": "invalid toxic type", "status": 400})
    assert api(server, "POST", "/proxies", data=b"{not json").status_code == 400
    assert api(server, "POST", "/proxies", json={"name": "x"}).json()["error"] == "missing required field: upstream"
    assert api(server, "GET", "/version", headers={"User-Agent": "Mozilla/5.0"}).status_code == 403


def test_only_loopback_addresses_are_accepted(toxiproxy: Toxiproxy, echo_port: int) -> None:
    with pytest.raises(InvalidToxic):  # the client's name for any 400
        toxiproxy.create(upstream=f"127.0.0.1:{echo_port}", name="open", listen="0.0.0.0:0")
    with pytest.raises(InvalidToxic):
        toxiproxy.create(upstream="192.0.2.1:80", name="far")
    with pytest.raises(InvalidToxic):
        toxiproxy.create(upstream="example.com:80", name="named")
    assert toxiproxy.proxies() == {}


def test_populate_creates_proxies_and_keeps_unchanged_ones(toxiproxy: Toxiproxy, echo_port: int,
                                                           server: ToxiproxyHandle) -> None:
    proxy = make_proxy(toxiproxy, echo_port, name="kept")
    wanted = [{"name": "kept", "listen": proxy.listen, "upstream": f"127.0.0.1:{echo_port}"},
              {"name": "new", "listen": "127.0.0.1:0", "upstream": f"127.0.0.1:{echo_port}"}]
    answer = api(server, "POST", "/populate", json=wanted)
    assert answer.status_code == 201
    assert [entry["name"] for entry in answer.json()["proxies"]] == ["kept", "new"]
    assert answer.json()["proxies"][0]["listen"] == proxy.listen
    assert set(toxiproxy.proxies()) == {"kept", "new"}
    assert api(server, "POST", "/populate", json=[{"name": "bad"}]).status_code == 400


# --- Traffic and toxics -------------------------------------------------------------------


def test_traffic_passes_through_a_proxy(toxiproxy: Toxiproxy, echo_port: int) -> None:
    proxy = make_proxy(toxiproxy, echo_port)
    with connect(proxy) as first, connect(proxy) as second:
        assert round_trip_s(first, b"hello") < 1.0
        assert round_trip_s(second, b"x" * 200_000) < 2.0


def test_latency_delays_live_connections_and_follows_updates_and_removal(toxiproxy: Toxiproxy, echo_port: int,
                                                                         server: ToxiproxyHandle) -> None:
    proxy = make_proxy(toxiproxy, echo_port)
    with connect(proxy) as sock:
        assert round_trip_s(sock) < 0.1
        proxy.add_toxic(type="latency", attributes={"latency": 300})
        assert 0.29 <= round_trip_s(sock) < 1.0
        answer = api(server, "POST", "/proxies/echo/toxics/latency_downstream", json={"attributes": {"latency": 100}})
        assert answer.json()["attributes"] == {"latency": 100, "jitter": 0}
        assert 0.09 <= round_trip_s(sock) < 0.29
        proxy.destroy_toxic("latency_downstream")
        assert round_trip_s(sock) < 0.09


def test_latency_held_data_is_released_when_the_toxic_is_removed(toxiproxy: Toxiproxy, echo_port: int) -> None:
    proxy = make_proxy(toxiproxy, echo_port)
    with connect(proxy) as sock:
        proxy.add_toxic(type="latency", attributes={"latency": 10_000})
        started = time.monotonic()
        sock.sendall(b"held")
        time.sleep(0.2)
        proxy.destroy_toxic("latency_downstream")
        assert receive_exactly(sock, 4) == b"held"
        assert time.monotonic() - started < 2.0


def test_upstream_latency_delays_the_client_to_server_direction(toxiproxy: Toxiproxy, echo_port: int) -> None:
    proxy = make_proxy(toxiproxy, echo_port)
    proxy.add_toxic(type="latency", stream="upstream", attributes={"latency": 200})
    assert set(proxy.toxics()) == {"latency_upstream"}
    with connect(proxy) as sock:
        assert 0.19 <= round_trip_s(sock) < 1.0


def test_bandwidth_limits_throughput(toxiproxy: Toxiproxy, echo_port: int) -> None:
    proxy = make_proxy(toxiproxy, echo_port)
    payload = b"b" * 50_000
    with connect(proxy) as sock:
        assert round_trip_s(sock, payload) < 0.3
        proxy.add_toxic(type="bandwidth", attributes={"rate": 100})  # 100 KB/s: 0.5 s for 50 KB
        assert 0.4 <= round_trip_s(sock, payload) < 3.0


def test_timeout_zero_holds_data_until_removed_then_closes(toxiproxy: Toxiproxy, echo_port: int) -> None:
    proxy = make_proxy(toxiproxy, echo_port)
    with connect(proxy) as sock:
        proxy.add_toxic(type="timeout", attributes={"timeout": 0})
        sock.sendall(b"lost")
        sock.settimeout(0.5)
        with pytest.raises(TimeoutError):
            sock.recv(10)
        sock.settimeout(SOCKET_TIMEOUT_S)
        proxy.destroy_toxic("timeout_downstream")
        assert read_until_closed(sock) == b""


def test_timeout_closes_the_connection_after_its_delay(toxiproxy: Toxiproxy, echo_port: int) -> None:
    proxy = make_proxy(toxiproxy, echo_port)
    proxy.add_toxic(type="timeout", attributes={"timeout": 300})
    with connect(proxy) as sock:
        started = time.monotonic()
        sock.sendall(b"lost")
        assert read_until_closed(sock) == b""
        assert 0.25 <= time.monotonic() - started < 2.0


def test_reset_peer_resets_the_connection(toxiproxy: Toxiproxy, echo_port: int) -> None:
    proxy = make_proxy(toxiproxy, echo_port)
    proxy.add_toxic(type="reset_peer", attributes={"timeout": 100})
    with connect(proxy) as sock:
        sock.sendall(b"reset me")
        with pytest.raises(ConnectionResetError):
            read_until_closed(sock)


def test_limit_data_closes_after_the_given_bytes(toxiproxy: Toxiproxy, echo_port: int) -> None:
    proxy = make_proxy(toxiproxy, echo_port)
    proxy.add_toxic(type="limit_data", attributes={"bytes": 10})
    with connect(proxy) as sock:
        sock.sendall(b"0123456789abcdefghij")
        assert read_until_closed(sock) == b"0123456789"


def test_slow_close_delays_the_close(toxiproxy: Toxiproxy, echo_port: int) -> None:
    proxy = make_proxy(toxiproxy, echo_port)
    proxy.add_toxic(type="slow_close", attributes={"delay": 400})
    with connect(proxy) as sock:
        sock.sendall(b"BYE")  # the echo upstream answers, then closes
        assert receive_exactly(sock, 3) == b"BYE"
        echoed = time.monotonic()
        assert read_until_closed(sock) == b""
        assert 0.35 <= time.monotonic() - echoed < 2.0


def test_a_toxic_with_toxicity_zero_has_no_effect(toxiproxy: Toxiproxy, echo_port: int) -> None:
    proxy = make_proxy(toxiproxy, echo_port)
    proxy.add_toxic(type="latency", toxicity=0.0, attributes={"latency": 1000})
    assert proxy.get_toxic("latency_downstream").toxicity == 0.0
    with connect(proxy) as sock:
        assert round_trip_s(sock) < 0.5


def test_disabling_drops_connections_and_refuses_new_ones_until_enabled(toxiproxy: Toxiproxy,
                                                                       echo_port: int) -> None:
    proxy = make_proxy(toxiproxy, echo_port)
    with connect(proxy) as sock:
        assert round_trip_s(sock) < 1.0
        proxy.disable()
        assert toxiproxy.get_proxy("echo").enabled is False
        try:
            assert read_until_closed(sock) == b""
        except ConnectionResetError:
            pass
    with pytest.raises(ConnectionRefusedError):
        connect(proxy).close()
    proxy.enable()
    with connect(proxy) as sock:
        assert round_trip_s(sock) < 1.0
    with proxy.down():
        with pytest.raises(ConnectionRefusedError):
            connect(proxy).close()
    with connect(proxy) as sock:
        assert round_trip_s(sock) < 1.0


def test_reset_enables_every_proxy_and_removes_every_toxic(toxiproxy: Toxiproxy, echo_port: int) -> None:
    first = make_proxy(toxiproxy, echo_port, name="first")
    second = make_proxy(toxiproxy, echo_port, name="second")
    first.add_toxic(type="latency", attributes={"latency": 1000})
    second.add_toxic(type="bandwidth", stream="upstream", attributes={"rate": 1})
    second.disable()
    with connect(first) as sock:
        assert toxiproxy.reset()
        assert round_trip_s(sock) < 0.5  # the live connection lost its latency too
    assert all(proxy.enabled and proxy.toxics() == {} for proxy in toxiproxy.proxies().values())
    with connect(second) as sock:
        assert round_trip_s(sock) < 0.5


# --- Starting a server --------------------------------------------------------------------


def test_start_can_run_the_server_as_a_subprocess(echo_port: int) -> None:
    handle = start(backend="subprocess")
    try:
        assert handle.kind == "subprocess"
        answer = requests.post(handle.url + "/proxies", timeout=SOCKET_TIMEOUT_S,
                               json={"name": "sub", "upstream": f"127.0.0.1:{echo_port}"})
        assert answer.status_code == 201
        port = int(answer.json()["listen"].rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT_S) as sock:
            assert round_trip_s(sock) < 1.0
    finally:
        handle.stop()
    with pytest.raises(requests.ConnectionError):
        requests.get(handle.url + "/version", timeout=SOCKET_TIMEOUT_S)


def test_start_refuses_a_non_loopback_api_address() -> None:
    with pytest.raises(ValueError):
        start("0.0.0.0", backend="thread")
