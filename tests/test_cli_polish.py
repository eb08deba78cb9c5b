"""What a new user meets following the README (issue 39, items 4 and 8): qctl's help, its
output for people, its refusals, and the grant rule for an ack refused for want of `delete`.

Pure renderings are checked directly; what the server or a terminal decides is checked against
real processes (a `qnode`, a two-node cluster, qctl under a pseudo-terminal).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import pty
import select
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from client import AsyncClient, QueueError
from client.credentials import Credentials, save_credentials
from client.qctl import build_parser
from client.qctl_features import forward_stats_shown
from client.qctl_queues import created_summary
from client.qctl_render import when_text
from qserver import cli as qserver_cli
from qserver.dev import local as qserver_local
from qserver.dev.devcluster import free_port
from qserver.features.macro.api import _attempt
from replication.cluster_map import CreateMacro, DeleteMacro, PutMacroMember, RemoveMacroMember
from replication.options import OptionError, parse_options, range_text
from tests.support import RawApi, raw_session
from tests.test_client_integration import run_qctl
from wire.protocol import AckOp, ErrorReply, ReceiveOp, decode_server_frame, encode_frame
from wire.signing import Signer, new_private_key, private_key_from_text, private_key_to_text

REPOSITORY = Path(__file__).resolve().parent.parent


# --- help texts ------------------------------------------------------------------------------------
def options_without_help(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """Every option (not positional) of the parser and its subcommands that has no help text."""
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                missing += options_without_help(sub, f"{path} {name}")
        elif action.option_strings and not (action.help or "").strip():
            missing.append(f"{path} {'/'.join(action.option_strings)}")
    return missing


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def parser_built_by(entry: Callable[[], object], monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """The parser an entry point builds inline, caught when it parses (nothing else runs)."""
    def caught(parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        raise _Parsed(parser)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", caught)
    with pytest.raises(_Parsed) as parsed:
        entry()
    return parsed.value.parser


def test_every_qctl_option_has_a_help_text() -> None:
    assert options_without_help(build_parser(), "qctl") == []


def test_every_qserver_and_local_demo_option_has_a_help_text(monkeypatch: pytest.MonkeyPatch) -> None:
    qserver = parser_built_by(lambda: qserver_cli.main(["run"]), monkeypatch)
    demo = parser_built_by(lambda: qserver_local._parse([]), monkeypatch)
    assert options_without_help(qserver, "qserver") + options_without_help(demo, "qserver.dev.local") == []


def test_the_top_level_help_names_the_clients_commands_as_they_are_and_a_consumers_grant() -> None:
    parser = build_parser()
    top = parser.format_help()
    assert "add, list and remove clients" in top and "register" not in top
    clients = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["clients"]
    add = next(a for a in clients._actions if isinstance(a, argparse._SubParsersAction)).choices["add"]
    grant = next(a for a in add._actions if "--grant" in a.option_strings)
    assert "a consumer's 'orders.*:get,delete'" in str(grant.help)


# --- output for people -----------------------------------------------------------------------------
def test_queue_create_shows_what_was_set_and_leaves_the_internals_to_json() -> None:
    description = {"created": True, "name": "billing", "incarnation": 37125, "state": "OPEN",
                   "options": {"strength": "full", "max_depth": 100000, "type": "queued_ack",
                               "visibility_timeout_s": 30.0, "max_deliveries": 10, "dead_letter": True,
                               "min_in_sync": 1, "message_ttl_s": 60.0, "forward_mode": "adaptive"},
                   "master": "n1", "replica": "n2", "digest": "00" * 16, "appends_sent": 0, "next_index": 1}
    assert created_summary(description) == {"queue": "billing (created)", "strength": "full", "type": "queued_ack",
                                            "max_depth": 100000, "message_ttl_s": 60.0, "master": "n1",
                                            "replica": "n2"}
    assert created_summary({**description, "created": False})["queue"] == "billing (it existed: opened)"


def test_forward_stats_show_times_as_local_iso_with_their_age_and_floors_by_priority() -> None:
    now_s = 1_780_000_000.0
    stats = {"name": "outbox-collect", "created_ms": int((now_s - 200) * 1000), "state": "open",
             "floors": {"4": 7, "9": 12}, "rate_trace": [[now_s, 500.0, 0]], "terms": {"interval_s": 2.0}}
    shown = forward_stats_shown(stats, now_s)
    assert shown["created"].endswith("(3 min ago)") and shown["created"].startswith(time.strftime(
        "%Y-%m-%dT%H:%M:%S", time.localtime(now_s - 200)))
    assert shown["floors"] == "priority 4 from id 7, priority 9 from id 12"
    assert "created_ms" not in shown and "rate_trace" not in shown and "terms" not in shown
    assert when_text(now_s + 7_200, now_s).endswith("(in 2 h)")


def test_option_range_errors_write_durations_and_big_numbers_for_people() -> None:
    assert range_text("ttl_s", 0.001, 1_209_600.0) == "ttl_s must be between 0.001 s (1 ms) and 1,209,600 s (14 days)"
    assert range_text("forward_interval_s", 0.05, 3_600.0) == \
        "forward_interval_s must be between 0.05 s (50 ms) and 3,600 s (1 hour)"
    assert range_text("max_depth", 1, 2**40) == "max_depth must be between 1 and 1,099,511,627,776"
    with pytest.raises(OptionError, match=r"between 0 and 1,209,600 s \(14 days\)"):
        parse_options({"message_ttl_s": 99_999_999})


def test_macro_refusals_name_what_the_caller_asked_for_not_the_map_command() -> None:
    assert _attempt(PutMacroMember("shop", "ue")) == "cannot add queue ue to macro queue shop"
    assert _attempt(RemoveMacroMember("shop", "eu")) == "cannot remove queue eu from macro queue shop"
    assert _attempt(CreateMacro("shop", "all", "round_robin")) == "cannot create macro queue shop"
    assert _attempt(DeleteMacro("shop")) == "cannot delete macro queue shop"


def test_a_put_waiting_on_a_terminal_says_that_it_reads_stdin(tmp_path: Path) -> None:
    credentials = tmp_path / "credentials.json"
    save_credentials(credentials, Credentials("c-1", private_key_to_text(new_private_key()),
                                              f"http://127.0.0.1:{free_port()}"))
    terminal, terminal_side = pty.openpty()
    process = subprocess.Popen([sys.executable, "-m", "client.qctl", "--credentials", str(credentials), "put", "jobs"],
                               stdin=terminal_side, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               cwd=REPOSITORY)
    os.close(terminal_side)
    try:
        assert process.stderr is not None
        ready, _, _ = select.select([process.stderr], [], [], 30)
        assert ready, "qctl put said nothing while it waited on the terminal"
        assert "reading the payload from stdin" in process.stderr.readline().decode()
        assert process.poll() is None              # still waiting for the payload
    finally:
        process.kill()
        process.wait(timeout=10)
        process.stderr.close()                     # type: ignore[union-attr]
        os.close(terminal)


# --- against a node --------------------------------------------------------------------------------
def qctl_process(qnode: Any, *argv: str, stdin: int | None = subprocess.DEVNULL) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "client.qctl", "--credentials", str(qnode.credentials_path), *argv],
                          stdin=stdin, capture_output=True, text=True, cwd=REPOSITORY, timeout=60)


@pytest.mark.asyncio
async def test_an_ack_refused_for_want_of_delete_releases_the_lease_and_says_so(qnode: Any, tmp_path: Path) -> None:
    """docs/PROTOCOL.md "Grants": `qctl get --ack` by a client with `get` only leases the
    message, is refused the ack, and the message is ready again at once, not after its lease."""
    taker = tmp_path / "taker.json"
    assert (await asyncio.to_thread(run_qctl, qnode, "clients", "add", "taker", "--grant", "jobs:get",
                                    "--out", str(taker)))[0] == 0
    assert (await asyncio.to_thread(run_qctl, qnode, "queue", "create", "jobs", "--visibility-timeout-s", "600"))[0] == 0
    assert (await asyncio.to_thread(run_qctl, qnode, "put", "jobs", "work"))[0] == 0
    refused = await asyncio.to_thread(qctl_process, qnode, "--credentials", str(taker), "get", "jobs", "--ack")
    assert refused.returncode == 1
    assert refused.stderr.startswith("error: E_FORBIDDEN: client ") and "message 1 was released instead" in refused.stderr
    async with AsyncClient(credentials=str(taker)) as client:     # over the WebSocket: the same rule
        [again] = await client.receive("jobs")
        assert (again.id, again.deliveries) == (1, 2)
        with pytest.raises(QueueError) as caught:
            await again.ack()
        assert caught.value.code == "E_FORBIDDEN" and "message 1 was released instead" in caught.value.message
        [third] = await client.receive("jobs")
        assert third.deliveries == 3
    stats = (await asyncio.to_thread(run_qctl, qnode, "queue", "stats", "jobs"))[1]
    assert (stats["depth"], stats["in_flight"]) == (1, 1)


@pytest.mark.asyncio
async def test_a_single_websocket_ack_refused_for_want_of_delete_releases_its_lease_too(qnode: Any) -> None:
    """The client library batches its acks (AckBatchOp, above); another client may send one AckOp."""
    async with raw_session() as session:
        admin = RawApi.for_credentials(session, qnode.credentials_path)
        await admin.request("PUT", "/v1/queues/jobs", {})
        await admin.request("POST", "/v1/queues/jobs/messages", b"work")
        status, body, _ = await admin.request("POST", "/v1/clients", {
            "name": "taker", "grants": [{"pattern": "jobs", "privileges": ["get"]}]})
        assert status == 201
        taker = RawApi(session, admin.url, Signer(body["id"], private_key_from_text(body["private_key"])))
        ws = await taker.ws()
        try:
            [leased] = await exchange(ws, ReceiveOp(1, "jobs", 1, 0, 600_000))
            message_id, receipt = leased.result[0][0], leased.result[0][1]
            [refused] = await exchange(ws, AckOp(2, "jobs", message_id, receipt))
            assert isinstance(refused, ErrorReply) and refused.code == "E_FORBIDDEN"
            assert f"message {message_id} was released instead" in refused.message
            [again] = await exchange(ws, ReceiveOp(3, "jobs", 1, 0, 600_000))
            assert (again.result[0][0], again.result[0][3]) == (message_id, 2)      # id, deliveries
        finally:
            await ws.close()


async def exchange(ws: aiohttp.ClientWebSocketResponse, op: Any) -> list[Any]:
    await ws.send_bytes(encode_frame([op]))
    message = await asyncio.wait_for(ws.receive(), 5)
    return list(decode_server_frame(message.data))


def test_an_empty_payload_from_stdin_is_refused_unless_meant(qnode: Any) -> None:
    assert qctl_process(qnode, "queue", "create", "jobs").returncode == 0
    refused = qctl_process(qnode, "put", "jobs")                     # stdin: /dev/null
    assert refused.returncode == 1 and refused.stderr.startswith("error: E_INVALID_OPTION: the payload from stdin "
                                                                 "is empty: pass --empty")
    assert qctl_process(qnode, "put", "jobs", "--empty").stdout.strip() == "id: 1"
    assert qctl_process(qnode, "put", "jobs", "").stdout.strip() == "id: 2"
    assert run_qctl(qnode, "queue", "stats", "jobs")[1]["depth"] == 2


def test_queue_errors_name_the_queue_typed_and_say_what_a_receipt_does_not_match(qnode: Any) -> None:
    created = qctl_process(qnode, "queue", "create", "billing", "--max-depth", "100")
    assert created.stdout.splitlines() == ["queue:     billing (created)", "strength:  producer",
                                           "type:      queued_ack", "max_depth: 100", "master:    n1",
                                           "replica:   -"]
    code, document, err = run_qctl(qnode, "queue", "redrive", "biling")
    assert code == 1 and err == "error: E_UNKNOWN_QUEUE: no queue named 'biling'\n"
    run_qctl(qnode, "put", "billing", "x")
    run_qctl(qnode, "get", "billing")
    code, document, err = run_qctl(qnode, "ack", "billing", "1", "0" * 16)
    assert code == 1 and "the receipt does not match message 1's current lease" in err
    code, document, err = run_qctl(qnode, "put", "billing", "x", "--ttl-s", "99999999")
    assert err == "error: E_INVALID_OPTION: ttl_s must be between 0.001 s (1 ms) and 1,209,600 s (14 days)\n"


def test_channel_listen_that_hears_fewer_than_count_prints_them_and_exits_1(qcluster_factory: Any) -> None:
    cluster = qcluster_factory(2)
    assert run_qctl(cluster, "channel", "create", "prices")[0] == 0
    assert run_qctl(cluster, "channel", "publish", "prices", "10.00")[0] == 0
    code, document, err = run_qctl(cluster, "channel", "listen", "prices", "--count", "3", "--wait-s", "0.5")
    assert code == 1 and [m["payload"] for m in document["messages"]] == ["10.00"]
    assert err == "error: E_TIMEOUT: 1 of 3 messages came, then none for 0.5 s (--wait-s)\n"
    assert run_qctl(cluster, "channel", "listen", "prices", "--count", "1", "--wait-s", "5")[0] == 0
