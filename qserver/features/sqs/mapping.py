"""SQS's words in ours: message attributes and our headers, the MD5 digests SDKs check, receipt
handles, queue URLs and ARNs, and queue attributes and our queue options (docs/SQS.md, "What
differs"). Pure functions.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
import struct
from collections.abc import Mapping
from typing import Any

from qserver.features.sqs.errors import (
    INVALID_ATTRIBUTE_NAME,
    INVALID_ATTRIBUTE_VALUE,
    INVALID_PARAMETER_VALUE,
    RECEIPT_HANDLE_IS_INVALID,
    SqsError,
)
from replication.options import DEAD_LETTER_SUFFIX, is_valid_queue_name
from wire.message_input import HEADER_NAME_CHARS_MAX, RESERVED_HEADERS

ACCOUNT = "000000000000"
MESSAGE_BYTES_MAX = 262_144             # SQS's MaximumMessageSize (256 KiB), the largest body we take
ATTRIBUTES_MAX = 10                     # message attributes per message (as SQS)
RETENTION_NONE_S = 1_209_600            # reported for a queue whose messages never expire (14 days, SQS's most)
# Reserved headers the gateway keeps beside a message's attributes (never shown as attributes).
RESERVED_PREFIX = "sqs."
TYPES_HEADER = "sqs.types"              # JSON {attribute: DataType} for every attribute that is not "String"
SENT_HEADER = "sqs.sent"                # SentTimestamp (ms) of a SendMessage
SENDER_HEADER = "sqs.sender"            # SenderId: the sending client's id
DEDUPE_HEADER = "sqs.dedupe"            # MessageDeduplicationId as given
_QUEUE_PATH = re.compile(r"/sqs/(\d{12})/([^/?#]+)/?")
_ATTRIBUTE_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_DATA_TYPE = re.compile(r"(String|Number|Binary)(\.[A-Za-z0-9_.-]{1,250})?")


def invalid(message: str, our_code: str = "E_INVALID_OPTION") -> SqsError:
    return SqsError(INVALID_PARAMETER_VALUE, message, our_code)


# --- queue URLs and ARNs ------------------------------------------------------------------------
def queue_url(base_url: str, name: str) -> str:
    return f"{base_url.rstrip('/')}/sqs/{ACCOUNT}/{name}"


def queue_from_url(url: Any) -> str:
    """The queue a QueueUrl names (any host, any 12-digit account), or SqsError."""
    if not isinstance(url, str) or not url:
        raise SqsError(INVALID_PARAMETER_VALUE, "QueueUrl is required", "E_BAD_REQUEST")
    path = url.split("://", 1)[-1]
    path = path[path.find("/"):] if "/" in path else ""
    match = _QUEUE_PATH.fullmatch(path.split("?", 1)[0])
    if match is None or not is_valid_queue_name(match.group(2)):
        raise invalid(f"Value {url[:200]} for parameter QueueUrl is invalid. Reason: not a queue URL of this "
                      f"service (http://<node>/sqs/{ACCOUNT}/<queue>).", "E_INVALID_NAME")
    return match.group(2)


def queue_arn(region: str, name: str) -> str:
    return f"arn:aws:sqs:{region}:{ACCOUNT}:{name}"


def queue_from_arn(arn: Any) -> str:
    parts = arn.split(":") if isinstance(arn, str) else []
    if len(parts) != 6 or parts[:3] != ["arn", "aws", "sqs"] or not is_valid_queue_name(parts[5]):
        raise SqsError(INVALID_ATTRIBUTE_VALUE, f"not an SQS queue ARN: {str(arn)[:200]} "
                                                f"(arn:aws:sqs:<region>:{ACCOUNT}:<queue>)", "E_INVALID_OPTION")
    return parts[5]


# --- receipt handles ----------------------------------------------------------------------------
def receipt_handle(queue: str, message_id: int, receipt: str, node_id: str) -> str:
    """Opaque to the SDK, url-safe: the queue, the message, our receipt and the node that
    leased it (under `producer` each member keeps its own leases)."""
    raw = json.dumps([queue, message_id, receipt, node_id], separators=(",", ":")).encode()
    return "qc1." + base64.urlsafe_b64encode(raw).decode().rstrip("=")


def parse_receipt_handle(handle: Any, queue: str) -> tuple[int, str, str]:
    """(message id, receipt, node id) of a handle this gateway gave for `queue`, or SqsError."""
    try:
        if not isinstance(handle, str) or not handle.startswith("qc1.") or len(handle) > 2048:
            raise ValueError("not ours")
        text = handle[4:]
        named, message_id, receipt, node_id = json.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
        if not (isinstance(named, str) and type(message_id) is int and isinstance(receipt, str)
                and isinstance(node_id, str)):
            raise ValueError("malformed")
    except (ValueError, TypeError, binascii.Error):
        raise SqsError(RECEIPT_HANDLE_IS_INVALID, f'The input receipt handle "{str(handle)[:100]}" is not a valid '
                                                  "receipt handle.", "E_BAD_REQUEST") from None
    if named != queue:
        raise SqsError(RECEIPT_HANDLE_IS_INVALID, f"the receipt handle is for queue {named!r}, not {queue!r}",
                       "E_BAD_REQUEST")
    return message_id, receipt, node_id


# --- message attributes <-> headers -------------------------------------------------------------
def _string_value(name: str, attribute: Mapping[str, Any], data_type: str) -> tuple[bytes, str]:
    """The attribute's transport byte + value bytes (the digest's), and the header text."""
    if data_type.startswith("Binary"):
        raw = attribute.get("BinaryValue")
        if not isinstance(raw, str):
            raise invalid(f"The message attribute '{name}' with type 'Binary' must use field 'Binary'.")
        try:
            value = base64.b64decode(raw, validate=True)
        except binascii.Error:
            raise invalid(f"message attribute {name!r}: BinaryValue is not base64") from None
        return b"\x02" + struct.pack(">I", len(value)) + value, base64.b64encode(value).decode()
    text = attribute.get("StringValue")
    if not isinstance(text, str) or not text:
        raise invalid(f"The message attribute '{name}' must contain a non-empty message attribute value "
                      f"for message attribute type '{data_type.split('.')[0]}'.")
    if data_type.startswith("Number"):
        try:
            float(text)
        except ValueError:
            raise invalid(f"message attribute {name!r}: {text[:40]!r} is not a number") from None
    if not text.isprintable():
        raise invalid(f"message attribute {name!r}: qcluster headers hold printable characters only "
                      "(no control characters such as newlines)")
    encoded = text.encode()
    return b"\x01" + struct.pack(">I", len(encoded)) + encoded, text


def _length_prefixed(text: str) -> bytes:
    encoded = text.encode()
    return struct.pack(">I", len(encoded)) + encoded


def attributes_to_headers(attributes: Any) -> tuple[dict[str, str], str | None]:
    """Our headers for a SendMessage's MessageAttributes, and their MD5 as SQS computes it
    (None without attributes); SqsError for what SQS or our header limits refuse."""
    if attributes is None or attributes == {}:
        return {}, None
    if not isinstance(attributes, dict):
        raise invalid("MessageAttributes must be a map of names to attribute values")
    if len(attributes) > ATTRIBUTES_MAX:
        raise invalid(f"Number of message attributes [{len(attributes)}] exceeds the allowed maximum "
                      f"[{ATTRIBUTES_MAX}].")
    headers: dict[str, str] = {}
    types: dict[str, str] = {}
    digest = hashlib.md5(usedforsecurity=False)
    for name in sorted(attributes):
        attribute = attributes[name]
        if not _ATTRIBUTE_NAME.fullmatch(name) or name.startswith((".", "AWS.", "Amazon.")) or ".." in name \
                or name.endswith("."):
            raise invalid(f"Message attribute name '{name[:80]}' is invalid.")
        if len(name) > HEADER_NAME_CHARS_MAX or name.lower().startswith(RESERVED_PREFIX) \
                or name.lower() in RESERVED_HEADERS:
            raise invalid(f"message attribute name {name[:80]!r}: qcluster keeps names of at most "
                          f"{HEADER_NAME_CHARS_MAX} characters, not starting {RESERVED_PREFIX!r}")
        if not isinstance(attribute, dict):
            raise invalid(f"message attribute {name!r} must be a structure")
        data_type = attribute.get("DataType")
        if not isinstance(data_type, str) or not _DATA_TYPE.fullmatch(data_type):
            raise invalid(f"The message attribute '{name}' has an invalid message attribute type, the set of "
                          "supported type prefixes is Binary, Number, and String.")
        value_bytes, text = _string_value(name, attribute, data_type)
        digest.update(_length_prefixed(name) + _length_prefixed(data_type) + value_bytes)
        headers[name] = text
        if data_type != "String":
            types[name] = data_type
    if types:
        headers[TYPES_HEADER] = json.dumps(types, separators=(",", ":"))
    return headers, digest.hexdigest()


def _wanted(name: str, names: list[str]) -> bool:
    for pattern in names:
        if pattern in ("All", ".*") or pattern == name or (pattern.endswith(".*") and name.startswith(pattern[:-1])):
            return True
    return False


def headers_to_attributes(headers: Mapping[str, str], names: list[str]) -> tuple[dict[str, Any], str | None]:
    """The MessageAttributes a receive shows (those `names` asks for) and their MD5."""
    if not names:
        return {}, None
    try:
        types = json.loads(headers.get(TYPES_HEADER, "{}"))
        types = types if isinstance(types, dict) else {}
    except ValueError:
        types = {}
    shown: dict[str, Any] = {}
    digest = hashlib.md5(usedforsecurity=False)
    for name in sorted(headers):
        if name.startswith(RESERVED_PREFIX) or not _wanted(name, names):
            continue
        data_type = types.get(name, "String")
        text = headers[name]
        if data_type.startswith("Binary"):
            value = base64.b64decode(text)
            shown[name] = {"DataType": data_type, "BinaryValue": text}
            part = b"\x02" + struct.pack(">I", len(value)) + value
        else:
            shown[name] = {"DataType": data_type, "StringValue": text}
            part = b"\x01" + _length_prefixed(text)
        digest.update(_length_prefixed(name) + _length_prefixed(data_type) + part)
    return shown, (digest.hexdigest() if shown else None)


def md5_text(text: str) -> str:
    return hashlib.md5(text.encode(), usedforsecurity=False).hexdigest()


# --- queue attributes <-> our options -----------------------------------------------------------
SETTABLE = ("VisibilityTimeout", "MessageRetentionPeriod", "DelaySeconds", "ReceiveMessageWaitTimeSeconds",
            "RedrivePolicy", "MaximumMessageSize")
FIFO_ATTRIBUTES = ("FifoQueue", "ContentBasedDeduplication", "DeduplicationScope", "FifoThroughputLimit")
READ_ONLY = ("ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible",
             "ApproximateNumberOfMessagesDelayed", "QueueArn", "CreatedTimestamp", "LastModifiedTimestamp")
FIFO_REFUSAL = "FIFO queues are not supported by qcluster (message groups, exactly-once ordering)"


def _integer(name: str, value: Any, low: int, high: int) -> int:
    try:
        number = int(str(value).strip())
    except ValueError:
        number = low - 1
    if not low <= number <= high:
        raise SqsError(INVALID_ATTRIBUTE_VALUE, f"Invalid value for the parameter {name}: must be an integer "
                                                f"{low}..{high}", "E_INVALID_OPTION")
    return number


def attributes_to_options(attributes: Any, queue: str) -> dict[str, Any]:
    """Our queue options for CreateQueue's or SetQueueAttributes' Attributes."""
    if attributes is None:
        return {}
    if not isinstance(attributes, dict):
        raise invalid("Attributes must be a map of names to strings")
    options: dict[str, Any] = {}
    for name, value in attributes.items():
        if name in FIFO_ATTRIBUTES:
            if name == "FifoQueue" and str(value).lower() == "false":
                continue
            raise invalid(FIFO_REFUSAL)
        if name == "VisibilityTimeout":
            options["visibility_timeout_s"] = float(_integer(name, value, 0, 43_200))
        elif name == "MessageRetentionPeriod":
            options["message_ttl_s"] = float(_integer(name, value, 60, RETENTION_NONE_S))
        elif name == "DelaySeconds":
            options["delay_s"] = float(_integer(name, value, 0, 900))
        elif name == "ReceiveMessageWaitTimeSeconds":
            options["receive_wait_s"] = float(_integer(name, value, 0, 20))
        elif name == "MaximumMessageSize":
            if _integer(name, value, 1024, MESSAGE_BYTES_MAX) != MESSAGE_BYTES_MAX:
                raise SqsError(INVALID_ATTRIBUTE_VALUE, f"MaximumMessageSize is fixed at {MESSAGE_BYTES_MAX} in "
                                                        "qcluster", "E_INVALID_OPTION")
        elif name == "RedrivePolicy":
            options.update(_redrive(value, queue))
        elif name in READ_ONLY:
            raise SqsError(INVALID_ATTRIBUTE_NAME, f"Unknown Attribute {name}: it is read-only", "E_INVALID_OPTION")
        else:
            raise SqsError(INVALID_ATTRIBUTE_NAME, f"Unknown Attribute {name} (qcluster supports "
                                                   f"{', '.join(SETTABLE)})", "E_INVALID_OPTION")
    return options


def _redrive(value: Any, queue: str) -> dict[str, Any]:
    if value in ("", None):
        return {"dead_letter": False}
    try:
        policy = json.loads(value) if isinstance(value, str) else value
    except ValueError:
        policy = None
    if not isinstance(policy, dict) or "deadLetterTargetArn" not in policy or "maxReceiveCount" not in policy:
        raise SqsError(INVALID_ATTRIBUTE_VALUE, "Value for parameter RedrivePolicy is invalid. Reason: "
                                                "Redrive policy is not a valid JSON map of deadLetterTargetArn and "
                                                "maxReceiveCount.", "E_INVALID_OPTION")
    target = queue_from_arn(policy["deadLetterTargetArn"])
    if target != queue + DEAD_LETTER_SUFFIX:
        raise SqsError(INVALID_ATTRIBUTE_VALUE, f"Value for parameter RedrivePolicy is invalid. Reason: a qcluster "
                                                f"queue's dead-letter queue is always {queue}{DEAD_LETTER_SUFFIX} "
                                                f"(made with it): deadLetterTargetArn must name it, not {target}.",
                       "E_INVALID_OPTION")
    return {"dead_letter": True, "max_deliveries": _integer("maxReceiveCount", policy["maxReceiveCount"], 1, 1000)}


def options_to_attributes(options: Mapping[str, Any], stats: Mapping[str, Any] | None, queue: str,
                          region: str) -> dict[str, str]:
    """Every attribute GetQueueAttributes can show for a queue (the caller picks the names asked)."""
    ttl = int(options.get("message_ttl_s", 0) or 0)
    out = {"QueueArn": queue_arn(region, queue),
           "VisibilityTimeout": str(int(options.get("visibility_timeout_s", 30))),
           "MessageRetentionPeriod": str(ttl or RETENTION_NONE_S),
           "DelaySeconds": str(int(options.get("delay_s", 0) or 0)),
           "ReceiveMessageWaitTimeSeconds": str(int(options.get("receive_wait_s", 0) or 0)),
           "MaximumMessageSize": str(MESSAGE_BYTES_MAX)}
    if options.get("dead_letter", True):
        out["RedrivePolicy"] = json.dumps({"deadLetterTargetArn": queue_arn(region, queue + DEAD_LETTER_SUFFIX),
                                           "maxReceiveCount": int(options.get("max_deliveries", 10))})
    if stats is not None:
        out["ApproximateNumberOfMessages"] = str(int(stats.get("ready", 0)))
        out["ApproximateNumberOfMessagesNotVisible"] = str(int(stats.get("in_flight", 0)))
        out["ApproximateNumberOfMessagesDelayed"] = str(int(stats.get("delayed", 0)))
    return out
