"""`qctl` commands of the features: store-and-forward between clusters (forward), fault
surveillance (recipient), channels and macro queues.

One of the command groups client/qctl.py's parser dispatches to (qctl_render.py renders).
"""
from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from client.aio import AsyncClient
from client.credentials import load_credentials
from client.http import HttpClient
from client.qctl_queues import read_payload
from client.qctl_render import Outcome, format_fields, payload_fields, when_text
from wire.errors import E_INVALID_OPTION, E_TIMEOUT, QueueError


async def cmd_forward_create(http: HttpClient, args: argparse.Namespace) -> Outcome:
    urls, credentials = list(args.urls), None
    if args.remote_credentials:
        remote = load_credentials(args.remote_credentials)
        credentials = {"client_id": remote.client_id, "private_key": remote.private_key_text,
                       "ca_file": remote.ca_file}       # the other cluster's CA, for the forward's TLS
        urls = urls or [remote.url]
    answer = await http.create_forward(args.name, args.source, args.destination, urls=urls, credentials=credentials,
                                       control=forward_control_args(args))
    where = f" at {', '.join(answer['urls'])} as {answer['client_id']}" if answer.get("urls") else ""
    return Outcome(answer, f"forward {args.name}: {args.source} -> {args.destination}{where}")


def forward_control_args(args: argparse.Namespace, *, changing: bool = False) -> dict[str, Any]:
    """--bands (a number of uniform bands, or thresholds 0.5,0.8), --weights (one per band),
    --fill-unit, --fill-bytes: a forward's own control (docs/PROTOCOL.md "Forwards"). When
    changing, "default" puts a field back to the root's default (None)."""
    control: dict[str, Any] = {}
    for field in ("bands", "weights", "fill_unit", "fill_bytes"):
        text = getattr(args, field, None)
        if text is None:
            continue
        if changing and text == "default":
            control[field] = None
        elif field == "fill_unit":
            control[field] = text
        else:
            try:
                values = [float(v) if "." in v else int(v) for v in str(text).split(",") if v.strip()]
            except ValueError:
                raise QueueError(E_INVALID_OPTION, f"--{field.replace('_', '-')} is a number or a comma list") from None
            control[field] = values[0] if field == "fill_bytes" or (field == "bands" and "," not in str(text)) \
                else values
    return control


def add_forward_control_options(parser: argparse.ArgumentParser, *, changing: bool = False) -> None:
    default = " (\"default\": the root's)" if changing else ""
    parser.add_argument("--bands", help="fill bands: a number of uniform bands, or thresholds as fractions of the "
                                        "capacity, e.g. 0.5,0.8,0.95" + default)
    parser.add_argument("--weights", help="the weight of each band, e.g. 0,1,5,20 (default: the band's number)" + default)
    parser.add_argument("--fill-unit", choices=("messages", "bytes", *(("default",) if changing else ())),
                        help="what the fill counts: the source's messages against its max_depth, or their bytes "
                             "against --fill-bytes")
    parser.add_argument("--fill-bytes", help="the capacity a fill in bytes is measured against" + default)


async def cmd_forward_set(http: HttpClient, args: argparse.Namespace) -> Outcome:
    control = forward_control_args(args, changing=True)
    if not control:
        raise QueueError(E_INVALID_OPTION, "name what to change: --bands, --weights, --fill-unit, --fill-bytes")
    answer = await http.change_forward(args.name, control)
    shown = answer.get("control") or "the root's uniform bands"
    return Outcome(answer, f"forward {args.name}: control {shown}")


async def cmd_forward_list(http: HttpClient, args: argparse.Namespace) -> Outcome:
    forwards = await http.forwards()
    lines = [f"{f['name']}: {f['source']} -> {f['destination']}"
             + (f" at {', '.join(f['urls'])}" if f["urls"] else "") + f" (runs on {f['runs_on']})" for f in forwards]
    return Outcome({"forwards": forwards}, "\n".join(lines) or "no forwards")


async def cmd_forward_stats(http: HttpClient, args: argparse.Namespace) -> Outcome:
    stats = await http.forward_stats(args.name)
    return Outcome(stats, format_fields(forward_stats_shown(stats, time.time())))


def forward_stats_shown(stats: dict[str, Any], now_s: float) -> dict[str, Any]:
    """Forward statistics for people: times as local ISO times with their age, the streams'
    floors by priority; the rate trace and the root's terms stay in --json."""
    shown: dict[str, Any] = {}
    for key, value in stats.items():
        if key in ("rate_trace", "terms"):
            continue
        if key.endswith("_ms") and isinstance(value, (int, float)) and value > 0:
            shown[key.removesuffix("_ms")] = when_text(value / 1000, now_s)
        elif key == "fill" and isinstance(value, dict):
            # The source's fill in the forward's bands (docs/PROTOCOL.md "A forward's own bands and weights").
            shown["fill"] = (f"{value['amount']} of {value['capacity']} {value['unit']}, band {value['band']}, "
                             f"weight {value['weight']}" + (" (capped by the root's bands)" if value["capped"] else ""))
        elif key == "floors" and isinstance(value, dict):
            # A stream's floor: the lowest id of its priority the source still held (docs/PROTOCOL.md).
            shown["floors"] = ", ".join(f"priority {priority} from id {floor}" for priority, floor in value.items()) \
                or "-"
        else:
            shown[key] = value
    return shown


async def cmd_forward_delete(http: HttpClient, args: argparse.Namespace) -> Outcome:
    return Outcome(await http.delete_forward(args.name), f"forward {args.name} deleted")


RECIPIENT_HELP = """\
Fault surveillance of push recipients (seed 001). A recipient consumes a queue under a name
(consume(queue, recipient=NAME) in the client library); if it takes no message for its queue's
--fault-interval-s while messages wait, it is in fault, and what waits fails over to the first of
its alternatives that is ok (else back to its sender), until it takes a message again."""


RECIPIENT_SETUP = """\
the setup that works: each alternative consumes a queue of its own
  qctl queue create invoices --strength full --fault-interval-s 5
  qctl queue create invoices-b --strength full --fault-interval-s 5
  qctl recipient alternatives billing-a --set billing-b=invoices-b
  # billing-a consumes invoices, billing-b consumes invoices-b
While billing-a is in fault, what waits in invoices moves to invoices-b; once billing-a takes
a message again, what comes next is its own again. An alternative that consumes the same queue
(billing-b on invoices) is a second consumer of the same messages, which the mover cannot tell
apart: it moves none to billing-b, and billing-b, judged by what waits in invoices (billing-a's
probe, what the mover holds) though offered none of it, ends in fault too; the messages then
stay with the mover."""


async def cmd_recipient_alternatives(http: HttpClient, args: argparse.Namespace) -> Outcome:
    if args.clear or args.chain:
        answer = await http.set_alternatives(args.name, [] if args.clear else args.chain)
    else:
        answer = {"recipient": args.name, "alternatives": await http.alternatives(args.name)}
    named = [f"{name} ({queue})" for name, queue in zip(answer["alternatives"], answer.get("queues", ()), strict=False)]
    return Outcome(answer, f"{args.name}: " + (" -> ".join(named or answer["alternatives"]) or "no alternatives"))


async def cmd_recipient_list(http: HttpClient, args: argparse.Namespace) -> Outcome:
    recipients = await http.recipients()
    queues = {r["recipient"]: r.get("queue") for r in recipients}
    return Outcome({"recipients": recipients},
                   "\n".join(_recipient_text(r, queues) for r in recipients) or "no recipients")


def _recipient_text(recipient: dict[str, Any], queues: dict[str, str | None]) -> str:
    """One line; an alternative that consumes the recipient's own queue is marked: the mover
    never moves a message to it (see RECIPIENT_SETUP)."""
    state = f"{recipient['state']} on {recipient['queue']}" if recipient.get("state") else "never subscribed"
    why = f" ({recipient['reason']})" if recipient.get("reason") and recipient.get("state") != "ok" else ""
    chain = " -> ".join(other + (" (same queue: never used)" if recipient.get("queue")
                                 and queues.get(other) == recipient["queue"] else "")
                        for other in recipient["alternatives"])
    return f"{recipient['recipient']}: {state}{why}" + (f", alternatives {chain}" if chain else "")


async def cmd_recipient_remove(http: HttpClient, args: argparse.Namespace) -> Outcome:
    answer = await http.remove_recipient(args.name)
    named_by = answer.get("named_by") or []
    still = f"; still named in the alternatives of {', '.join(named_by)}" if named_by else ""
    return Outcome(answer, f"recipient {args.name} removed{still}")


async def cmd_channel_create(http: HttpClient, args: argparse.Namespace) -> Outcome:
    answer = await http.put_channel(args.name, args.delivery_class, args.resend_interval_s, size_bytes=args.size_bytes,
                                    per_second=args.per_second, loss_tolerant=args.loss_tolerant,
                                    skip_last_value=args.skip_last_value)
    return Outcome(answer, _channel_text(answer))


async def cmd_channel_list(http: HttpClient, args: argparse.Namespace) -> Outcome:
    channels = await http.list_channels()
    return Outcome({"channels": channels}, "\n".join(_channel_text(c) for c in channels) or "no channels")


async def cmd_channel_typeof(http: HttpClient, args: argparse.Namespace) -> Outcome:
    answer = await http.channel(args.name)
    return Outcome(answer, _channel_text(answer))


async def cmd_channel_delete(http: HttpClient, args: argparse.Namespace) -> Outcome:
    return Outcome(await http.delete_channel(args.name), f"deleted channel {args.name}")


async def cmd_channel_publish(http: HttpClient, args: argparse.Namespace) -> Outcome:
    payload = read_payload(args)
    answer = await http.publish_http(args.name, payload)
    return Outcome(answer, f"id: {answer['id']}")


async def cmd_channel_listen(http: HttpClient, args: argparse.Namespace) -> Outcome:
    """A subscriber through the client library (subscribing is on the WebSocket)."""
    received: list[dict[str, Any]] = []
    async with AsyncClient(http.url, load_credentials(args.credentials), ca_file=args.ca_file) as client:
        await client.subscribe(*args.names, durable=args.durable)
        while len(received) < args.count:
            try:
                message = await asyncio.wait_for(client.next_channel_message(), args.wait_s)
            except TimeoutError:
                break
            received.append({"channel": message.channel, "id": message.id, "resent": message.resent,
                             **payload_fields(message.payload)})
            if args.durable is not None:
                await message.ack()
    lines = [f"{m['channel']} {m['id']}{' (resent)' if m['resent'] else ''}: "
             + (m.get("payload") or m.get("payload_b64", "")) for m in received]
    shortfall = None if len(received) >= args.count else QueueError(
        E_TIMEOUT, f"{len(received)} of {args.count} messages came, then none for {args.wait_s:g} s (--wait-s)")
    return Outcome({"messages": received}, "\n".join(lines) or "no message", shortfall)


async def cmd_channel_subscriptions(http: HttpClient, args: argparse.Namespace) -> Outcome:
    listed = await http.subscriptions(args.name)
    lines = [f"{s['name']}: {s['waiting']} waiting, acknowledged up to {s['floor']}, "
             + (f"read here ({s['unacknowledged']} unacknowledged)" if s["attached"] else "no reader")
             for s in listed]
    return Outcome({"channel": args.name, "subscriptions": listed}, "\n".join(lines) or "no durable subscription")


async def cmd_channel_drop(http: HttpClient, args: argparse.Namespace) -> Outcome:
    answer = await http.drop_subscription(args.name, args.subscription)
    return Outcome(answer, f"dropped durable subscription {args.subscription} of {args.name}")


def _channel_text(channel: dict[str, Any]) -> str:
    resend = f", resent every {channel['resend_interval_s']:g} s" if channel.get("resend_interval_s") else ""
    attributes = "".join(f", {name} {value}" for name, value in channel.get("attributes", {}).items())
    mechanism = f", travels {channel['mechanism']}" if "mechanism" in channel else ""
    return (f"{channel['name']}: {channel['class']}{resend}{attributes}{mechanism}, master "
            f"{channel.get('master', '?')}, replica {channel.get('replica', '?')}")


async def cmd_macro_create(http: HttpClient, args: argparse.Namespace) -> Outcome:
    answer = await http.create_macro(args.name, args.producer, args.consumer, args.fastest_by)
    return Outcome(answer, _macro_text(answer))


async def cmd_macro_list(http: HttpClient, args: argparse.Namespace) -> Outcome:
    macros = await http.list_macros()
    return Outcome({"macros": macros}, "\n\n".join(_macro_text(m) for m in macros) or "no macro queues")


async def cmd_macro_describe(http: HttpClient, args: argparse.Namespace) -> Outcome:
    answer = await http.macro(args.name)
    return Outcome(answer, _macro_text(answer))


async def cmd_macro_delete(http: HttpClient, args: argparse.Namespace) -> Outcome:
    answer = await http.delete_macro(args.name)
    return Outcome(answer, f"deleted macro queue {args.name} (its members stay)")


async def cmd_macro_add(http: HttpClient, args: argparse.Namespace) -> Outcome:
    answer = await http.add_macro_member(args.name, args.queue, args.priority, args.weight)
    return Outcome(answer, _macro_text(answer))


async def cmd_macro_remove(http: HttpClient, args: argparse.Namespace) -> Outcome:
    answer = await http.remove_macro_member(args.name, args.queue)
    return Outcome(answer, _macro_text(answer))


def _macro_text(macro: dict[str, Any]) -> str:
    lines = [f"{macro['name']}: producer {macro['producer']}"
             + (f" by {macro['fastest_by']}" if macro["producer"] == "fastest" else "")
             + f", consumer {macro['consumer']}"]
    for member in macro.get("members", []):
        lines.append(f"  {member['queue']}: priority {member['priority']}, weight {member['weight']}, "
                     f"master {member.get('master', '?')}, replica {member.get('replica', '?')}")
    return "\n".join(lines)
