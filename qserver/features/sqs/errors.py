"""SQS's errors, and our E_* codes in SQS's terms: one table (docs/SQS.md, "Errors").

Every answer carries SQS's shape (the JSON protocol: `__type` and the `x-amzn-query-error`
header with the query protocol's code, which boto3 reports as the error code; the query
protocol: an XML ErrorResponse) and our own stable code beside it (`qclusterCode`, an element
SDKs ignore), so bad input gets a clear error in both vocabularies.
"""
from __future__ import annotations

from dataclasses import dataclass

from wire import errors as e
from wire.errors import QueueError


@dataclass(frozen=True, slots=True)
class Kind:
    shape: str       # the JSON protocol's __type (com.amazonaws.sqs#<shape>)
    code: str        # the query protocol's code (and x-amzn-query-error's)
    status: int


QUEUE_DOES_NOT_EXIST = Kind("QueueDoesNotExist", "AWS.SimpleQueueService.NonExistentQueue", 400)
QUEUE_NAME_EXISTS = Kind("QueueNameExists", "QueueAlreadyExists", 400)
INVALID_PARAMETER_VALUE = Kind("InvalidParameterValue", "InvalidParameterValue", 400)
MISSING_PARAMETER = Kind("MissingParameter", "MissingParameter", 400)
INVALID_ATTRIBUTE_NAME = Kind("InvalidAttributeName", "InvalidAttributeName", 400)
INVALID_ATTRIBUTE_VALUE = Kind("InvalidAttributeValue", "InvalidAttributeValue", 400)
RECEIPT_HANDLE_IS_INVALID = Kind("ReceiptHandleIsInvalid", "ReceiptHandleIsInvalid", 400)
MESSAGE_NOT_INFLIGHT = Kind("MessageNotInflight", "AWS.SimpleQueueService.MessageNotInflight", 400)
BATCH_IDS_NOT_DISTINCT = Kind("BatchEntryIdsNotDistinct", "AWS.SimpleQueueService.BatchEntryIdsNotDistinct", 400)
EMPTY_BATCH = Kind("EmptyBatchRequest", "AWS.SimpleQueueService.EmptyBatchRequest", 400)
TOO_MANY_ENTRIES = Kind("TooManyEntriesInBatchRequest", "AWS.SimpleQueueService.TooManyEntriesInBatchRequest", 400)
INVALID_BATCH_ENTRY_ID = Kind("InvalidBatchEntryId", "AWS.SimpleQueueService.InvalidBatchEntryId", 400)
BATCH_TOO_LONG = Kind("BatchRequestTooLong", "AWS.SimpleQueueService.BatchRequestTooLong", 400)
UNSUPPORTED_OPERATION = Kind("UnsupportedOperation", "AWS.SimpleQueueService.UnsupportedOperation", 400)
INVALID_ACTION = Kind("InvalidAction", "InvalidAction", 400)
OVER_LIMIT = Kind("OverLimit", "OverLimit", 403)
# Authentication and authorization: AWS's common errors (no SQS shape of their own).
MISSING_AUTHENTICATION_TOKEN = Kind("MissingAuthenticationToken", "MissingAuthenticationToken", 403)
INCOMPLETE_SIGNATURE = Kind("IncompleteSignature", "IncompleteSignature", 403)
INVALID_CLIENT_TOKEN_ID = Kind("InvalidClientTokenId", "InvalidClientTokenId", 403)
SIGNATURE_DOES_NOT_MATCH = Kind("SignatureDoesNotMatch", "SignatureDoesNotMatch", 403)
ACCESS_DENIED = Kind("AccessDenied", "AccessDenied", 403)
REQUEST_TOO_LARGE = Kind("RequestEntityTooLarge", "RequestEntityTooLarge", 413)
# 5xx: SDKs retry these with backoff, which is what our retriable codes ask for.
SERVICE_UNAVAILABLE = Kind("ServiceUnavailable", "ServiceUnavailable", 503)
INTERNAL_ERROR = Kind("InternalError", "InternalError", 500)

SIGV4_KINDS = {kind.code: kind for kind in (MISSING_AUTHENTICATION_TOKEN, INCOMPLETE_SIGNATURE,
                                             INVALID_CLIENT_TOKEN_ID, SIGNATURE_DOES_NOT_MATCH)}


class SqsError(Exception):
    def __init__(self, kind: Kind, message: str, our_code: str = "") -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.our_code = our_code or _OUR_DEFAULT.get(kind.code, "E_BAD_REQUEST")


# What a node's refusal (QueueError) becomes, by our code. A code not listed is a 400
# InvalidParameterValue naming it; any retriable one a 503 that SDKs retry.
BY_OUR_CODE: dict[str, Kind] = {
    e.E_UNKNOWN_QUEUE.code: QUEUE_DOES_NOT_EXIST,
    e.E_OPTIONS_MISMATCH.code: QUEUE_NAME_EXISTS,
    e.E_FORBIDDEN.code: ACCESS_DENIED,
    e.E_UNAUTHENTICATED.code: ACCESS_DENIED,
    e.E_UNKNOWN_CLIENT.code: INVALID_CLIENT_TOKEN_ID,
    e.E_INVALID_NAME.code: INVALID_PARAMETER_VALUE,
    e.E_INVALID_OPTION.code: INVALID_PARAMETER_VALUE,
    e.E_BAD_REQUEST.code: INVALID_PARAMETER_VALUE,
    e.E_BAD_JSON.code: INVALID_PARAMETER_VALUE,
    e.E_PAYLOAD_TOO_LARGE.code: INVALID_PARAMETER_VALUE,
    e.E_RESERVED_NAME.code: INVALID_PARAMETER_VALUE,
    e.E_RESERVED_HEADER.code: INVALID_PARAMETER_VALUE,
    e.E_QUEUE_FULL.code: OVER_LIMIT,
    e.E_UNKNOWN_MESSAGE.code: RECEIPT_HANDLE_IS_INVALID,
    e.E_LEASE_EXPIRED.code: MESSAGE_NOT_INFLIGHT,
    e.E_FEATURE_DISABLED.code: UNSUPPORTED_OPERATION,
    e.E_MACRO_QUEUE.code: UNSUPPORTED_OPERATION,
    e.E_WRONG_QUEUE_TYPE.code: UNSUPPORTED_OPERATION,
    e.E_INTERNAL.code: INTERNAL_ERROR,
}
_OUR_DEFAULT = {
    QUEUE_DOES_NOT_EXIST.code: e.E_UNKNOWN_QUEUE.code, ACCESS_DENIED.code: e.E_FORBIDDEN.code,
    MISSING_AUTHENTICATION_TOKEN.code: e.E_UNAUTHENTICATED.code, INCOMPLETE_SIGNATURE.code: e.E_UNAUTHENTICATED.code,
    INVALID_CLIENT_TOKEN_ID.code: e.E_UNAUTHENTICATED.code, SIGNATURE_DOES_NOT_MATCH.code: e.E_UNAUTHENTICATED.code,
    REQUEST_TOO_LARGE.code: e.E_PAYLOAD_TOO_LARGE.code, INTERNAL_ERROR.code: e.E_INTERNAL.code,
    QUEUE_NAME_EXISTS.code: e.E_OPTIONS_MISMATCH.code, INVALID_ACTION.code: e.E_NOT_FOUND.code,
}


def from_queue_error(error: QueueError) -> SqsError:
    kind = BY_OUR_CODE.get(error.code)
    if kind is None:
        kind = SERVICE_UNAVAILABLE if error.kind.retriable else INVALID_PARAMETER_VALUE
    return SqsError(kind, error.message, error.code)
