"""Toxics as Toxiproxy defines them: their JSON, their defaults and how the API validates them.

This module holds data and rules only (no sockets, no asyncio); `chaos.toxiproxy_server` runs
the toxics on live connections. Names, attributes, defaults, error messages and status codes
follow Shopify/toxiproxy v2 so that its clients (here `toxiproxy-python`) cannot tell the
difference. Where we are stricter than Toxiproxy (negative attributes, a toxicity outside 0..1)
the request is refused with 400 instead of being accepted and behaving oddly.
"""
from __future__ import annotations

import dataclasses
from typing import Any

STREAMS = ("upstream", "downstream")
STREAM_DEFAULT = "downstream"

# Each toxic type's attributes (all integers) with Toxiproxy's zero-value defaults. Times are
# milliseconds, `rate` is KB/s (1 KB = 1000 bytes), `bytes` is a byte count.
TOXIC_ATTRIBUTES: dict[str, dict[str, int]] = {
    "latency": {"latency": 0, "jitter": 0},
    "bandwidth": {"rate": 0},
    "timeout": {"timeout": 0},
    "reset_peer": {"timeout": 0},
    "slow_close": {"delay": 0},
    "limit_data": {"bytes": 0},
}

# Toxiproxy stores attributes as int64; a bound keeps timers and arithmetic sane.
ATTRIBUTE_VALUE_MAX = 2**53
TOXIC_NAME_LENGTH_MAX = 200


class ApiError(Exception):
    """An answer Toxiproxy gives as `{"error": message, "status": code}` with that HTTP status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.message = message
        self.status = status

    def to_json(self) -> dict[str, Any]:
        return {"error": self.message, "status": self.status}


def bad_request_body(detail: str) -> ApiError:
    return ApiError(f"bad request body: {detail}", 400)


def missing_field(field: str) -> ApiError:
    return ApiError(f"missing required field: {field}", 400)


def proxy_not_found() -> ApiError:
    return ApiError("proxy not found", 404)


def proxy_already_exists() -> ApiError:
    return ApiError("proxy already exists", 409)


def invalid_stream() -> ApiError:
    return ApiError("stream was invalid, can be either upstream or downstream", 400)


def invalid_toxic_type() -> ApiError:
    return ApiError("invalid toxic type", 400)


def toxic_already_exists() -> ApiError:
    return ApiError("toxic already exists", 409)


def toxic_not_found() -> ApiError:
    return ApiError("toxic not found", 404)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Toxic:
    """One toxic of a proxy. Immutable: an update replaces the object, which is how a live
    connection notices that it must re-run the toxic (new toxicity roll, restarted timers)."""

    name: str
    type: str
    stream: str
    toxicity: float
    attributes: dict[str, int]

    def attribute(self, key: str) -> int:
        return self.attributes[key]

    def to_json(self) -> dict[str, Any]:
        return {"attributes": dict(self.attributes), "name": self.name, "type": self.type,
                "stream": self.stream, "toxicity": self.toxicity}


def parse_new_toxic(body: object) -> Toxic:
    """The toxic a `POST /proxies/{proxy}/toxics` body describes, with Toxiproxy's defaults:
    stream downstream, toxicity 1, name `<type>_<stream>`, attributes zero."""
    if not isinstance(body, dict):
        raise bad_request_body("expected a JSON object")
    stream = _string_field(body, "stream", STREAM_DEFAULT)
    if stream not in STREAMS:
        raise invalid_stream()
    toxic_type = _string_field(body, "type", "")
    name = _string_field(body, "name", "") or f"{toxic_type}_{stream}"
    if toxic_type not in TOXIC_ATTRIBUTES:
        raise invalid_toxic_type()
    if len(name) > TOXIC_NAME_LENGTH_MAX:
        raise bad_request_body(f"name is longer than {TOXIC_NAME_LENGTH_MAX} characters")
    toxicity = _toxicity(body.get("toxicity", 1.0))
    attributes = _merged_attributes(toxic_type, dict(TOXIC_ATTRIBUTES[toxic_type]), body.get("attributes"))
    return Toxic(name=name, type=toxic_type, stream=stream, toxicity=toxicity, attributes=attributes)


def updated_toxic(toxic: Toxic, body: object) -> Toxic:
    """`POST /proxies/{proxy}/toxics/{toxic}`: attributes given replace the current ones (the
    others stay), toxicity likewise; name, type and stream cannot change."""
    if not isinstance(body, dict):
        raise bad_request_body("expected a JSON object")
    toxicity = _toxicity(body.get("toxicity", toxic.toxicity))
    attributes = _merged_attributes(toxic.type, dict(toxic.attributes), body.get("attributes"))
    return dataclasses.replace(toxic, toxicity=toxicity, attributes=attributes)


def _string_field(body: dict[str, Any], key: str, default: str) -> str:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, str):
        raise bad_request_body(f"{key} must be a string")
    return value


def _toxicity(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad_request_body("toxicity must be a number")
    if not 0.0 <= value <= 1.0:
        raise bad_request_body("toxicity must be between 0 and 1")
    return float(value)


def _merged_attributes(toxic_type: str, current: dict[str, int], given: object) -> dict[str, int]:
    """Known attributes from `given` over `current`; unknown keys are ignored, as Go's JSON
    decoder does. Values must be whole numbers (Toxiproxy's int64 fields)."""
    if given is None:
        return current
    if not isinstance(given, dict):
        raise bad_request_body("attributes must be a JSON object")
    for key in TOXIC_ATTRIBUTES[toxic_type]:
        if key not in given:
            continue
        value = given[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad_request_body(f"attribute {key} must be an integer")
        if not 0 <= value <= ATTRIBUTE_VALUE_MAX:
            raise bad_request_body(f"attribute {key} must be between 0 and {ATTRIBUTE_VALUE_MAX}")
        current[key] = value
    return current
