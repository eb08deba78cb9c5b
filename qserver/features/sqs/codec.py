"""The two ways SDKs speak SQS, read into one shape and written back.

The JSON protocol (current SDKs: `X-Amz-Target: AmazonSQS.<Action>`, a JSON body) is the shape
the actions take and give. The query protocol (older SDKs: form-encoded `Action=...` with
flattened names such as `Attribute.1.Name`, answered in XML) is turned into that shape here, and
its answers are rendered from it, so each action is written once (docs/SQS.md).
"""
from __future__ import annotations

import json
from typing import Any
from xml.sax.saxutils import escape

from qserver.features.sqs.errors import INVALID_PARAMETER_VALUE, SqsError

XMLNS = "http://queue.amazonaws.com/doc/2012-11-05/"
JSON_CONTENT_TYPE = "application/x-amz-json-1.0"
TARGET_PREFIX = "AmazonSQS."
QUERY_FIELDS_MAX = 1000          # flattened names in one query request (10 entries x 10 attributes x 4 ...)
_INDEX_MAX = 1000

# Query protocol lists of structures that become the JSON protocol's maps or lists.
_MAPS = {"Attribute": "Attributes", "MessageAttribute": "MessageAttributes",
         "MessageSystemAttribute": "MessageSystemAttributes", "Tag": "tags"}
_LISTS = {"AttributeName": "AttributeNames", "MessageAttributeName": "MessageAttributeNames",
          "MessageSystemAttributeName": "MessageSystemAttributeNames",
          "SendMessageBatchRequestEntry": "Entries", "DeleteMessageBatchRequestEntry": "Entries",
          "ChangeMessageVisibilityBatchRequestEntry": "Entries"}


def _insert(tree: dict[str, Any], parts: list[str], value: str) -> None:
    node: Any = tree
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if part.isdigit():
            index = int(part)
            if not 1 <= index <= _INDEX_MAX:
                raise _invalid(f"list index {part} out of range")
            if not isinstance(node, dict) or "#list" not in node:
                raise _invalid(f"unexpected index in {'.'.join(parts)}")
            node = node["#list"].setdefault(index, {} if not last else value)
            if last:
                node = value
            continue
        if not isinstance(node, dict):
            raise _invalid(f"conflicting parameter {'.'.join(parts)}")
        if last:
            node[part] = value
        else:
            following = parts[i + 1]
            node = node.setdefault(part, {"#list": {}} if following.isdigit() else {})


def _invalid(message: str) -> SqsError:
    return SqsError(INVALID_PARAMETER_VALUE, message, "E_BAD_REQUEST")


def _shape(node: Any) -> Any:
    """The JSON protocol's value for a parsed query subtree."""
    if not isinstance(node, dict):
        return node
    if "#list" in node:
        return [_shape(node["#list"][i]) for i in sorted(node["#list"])]
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _MAPS:
            entries = _shape(value)
            if not isinstance(entries, list):
                raise _invalid(f"{key} must be numbered ({key}.1.Name)")
            mapped: dict[str, Any] = {}
            for entry in entries:
                if not isinstance(entry, dict) or ("Name" not in entry and "Key" not in entry):
                    raise _invalid(f"each {key}.N needs a Name")
                mapped[str(entry.get("Name", entry.get("Key")))] = entry.get("Value")
            out[_MAPS[key]] = mapped
        elif key in _LISTS:
            out[_LISTS[key]] = _shape(value)
        else:
            out[key] = _shape(value)
    return out


def query_request(pairs: list[tuple[str, str]]) -> tuple[str, dict[str, Any]]:
    """(action, parameters in the JSON protocol's shape) of a query-protocol request."""
    if len(pairs) > QUERY_FIELDS_MAX:
        raise _invalid(f"at most {QUERY_FIELDS_MAX} parameters")
    tree: dict[str, Any] = {}
    action = ""
    for key, value in pairs:
        if key == "Action":
            action = value
        elif key in ("Version", "AWSAccessKeyId", "SignatureVersion", "SignatureMethod", "Timestamp",
                     "Signature", "Expires") or key.startswith("X-Amz-"):
            continue
        else:
            parts = key.split(".")
            if any(not part for part in parts):
                raise _invalid(f"malformed parameter name {key[:80]!r}")
            _insert(tree, parts, value)
    return action, _shape(tree)


def json_request(target: str, body: bytes) -> tuple[str, dict[str, Any]]:
    action = target[len(TARGET_PREFIX):] if target.startswith(TARGET_PREFIX) else ""
    try:
        params = json.loads(body) if body.strip() else {}
    except (ValueError, UnicodeDecodeError) as error:
        raise _invalid(f"the body is not JSON: {error}") from None
    if not isinstance(params, dict):
        raise _invalid("the body must be a JSON object")
    return action, params


# --- answers ------------------------------------------------------------------------------------
_ITEM_NAMES = {"QueueUrls": "QueueUrl", "Messages": "Message", "Failed": "BatchResultErrorEntry"}


def _xml_value(name: str, value: Any, action: str) -> str:
    if value is None:
        return ""
    if name == "Attributes" and isinstance(value, dict):
        return "".join(f"<Attribute><Name>{escape(k)}</Name><Value>{escape(str(v))}</Value></Attribute>"
                       for k, v in value.items())
    if name == "MessageAttributes" and isinstance(value, dict):
        return "".join(f"<MessageAttribute><Name>{escape(k)}</Name><Value>{_xml_fields(v, action)}</Value>"
                       f"</MessageAttribute>" for k, v in value.items())
    if isinstance(value, list):
        item = _ITEM_NAMES.get(name) or f"{action}ResultEntry"
        return "".join(f"<{item}>{_xml_fields(v, action) if isinstance(v, dict) else escape(str(v))}</{item}>"
                       for v in value)
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, dict):
        return f"<{name}>{_xml_fields(value, action)}</{name}>"
    else:
        text = escape(str(value))
    return f"<{name}>{text}</{name}>"


def _xml_fields(fields: dict[str, Any], action: str) -> str:
    return "".join(_xml_value(name, value, action) for name, value in fields.items())


def xml_answer(action: str, result: dict[str, Any], request_id: str) -> str:
    inner = _xml_fields(result, action)
    body = f"<{action}Result>{inner}</{action}Result>" if inner else ""
    return (f'<?xml version="1.0"?><{action}Response xmlns="{XMLNS}">{body}'
            f"<ResponseMetadata><RequestId>{request_id}</RequestId></ResponseMetadata></{action}Response>")


def xml_error(error: SqsError, request_id: str) -> str:
    side = "Receiver" if error.kind.status >= 500 else "Sender"
    return (f'<?xml version="1.0"?><ErrorResponse xmlns="{XMLNS}"><Error><Type>{side}</Type>'
            f"<Code>{escape(error.kind.code)}</Code><Message>{escape(error.message)}</Message><Detail/>"
            f"<QclusterCode>{escape(error.our_code)}</QclusterCode></Error>"
            f"<RequestId>{request_id}</RequestId></ErrorResponse>")


def json_error(error: SqsError) -> tuple[dict[str, Any], dict[str, str]]:
    side = "Receiver" if error.kind.status >= 500 else "Sender"
    body = {"__type": f"com.amazonaws.sqs#{error.kind.shape}", "message": error.message,
            "qclusterCode": error.our_code}
    return body, {"x-amzn-query-error": f"{error.kind.code};{side}"}
