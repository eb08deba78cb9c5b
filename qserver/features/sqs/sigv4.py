"""AWS Signature Version 4, the server's side: what an SQS SDK signs and how we check it.

Pure: no clock, no I/O. `parse` reads who claims to have signed (the Authorization header, or
the presigned query form X-Amz-Algorithm/X-Amz-Credential/...); the caller looks the access key
up, then `verify` rebuilds the canonical request, the string to sign and the signing key
exactly as AWS documents them (and botocore's `SigV4Auth` computes them: the unit tests sign with
it) and compares in constant time. docs/SQS.md, "Authentication".
"""
from __future__ import annotations

import calendar
import functools
import hashlib
import hmac
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from urllib.parse import quote, unquote

ALGORITHM = "AWS4-HMAC-SHA256"
SERVICE = "sqs"
SKEW_MAX_S = 15 * 60              # AWS's own window for X-Amz-Date
PRESIGNED_EXPIRES_MAX_S = 7 * 24 * 3600
_CREDENTIAL = re.compile(r"([^/]{1,128})/(\d{8})/([a-z0-9-]{1,32})/([a-z0-9-]{1,32})/aws4_request")
_SIGNATURE = re.compile(r"[0-9a-f]{64}")
_AMZ_DATE = re.compile(r"\d{8}T\d{6}Z")


class SigV4Error(Exception):
    """A refused signature: `code` is the SQS error code the answer carries
    (MissingAuthenticationToken, IncompleteSignature, SignatureDoesNotMatch, ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class Request:
    """What the signature covers, as it came over the wire: the raw (still percent-encoded)
    path, the raw query text, the headers (any case; repeated names allowed) and the body."""
    method: str
    raw_path: str
    raw_query: str
    headers: tuple[tuple[str, str], ...]
    body: bytes

    @staticmethod
    def of(method: str, raw_path: str, raw_query: str, headers: Iterable[tuple[str, str]], body: bytes) -> Request:
        return Request(method, raw_path, raw_query, tuple(headers), body)

    def header(self, name: str) -> str | None:
        name = name.lower()
        values = [value for key, value in self.headers if key.lower() == name]
        return ",".join(values) if values else None


@dataclass(frozen=True, slots=True)
class Claim:
    """Who says they signed, and over what: from the Authorization header or the query."""
    key_id: str
    date: str              # yyyymmdd of the credential scope
    region: str
    service: str
    amz_date: str          # yyyymmddThhmmssZ
    signed_headers: tuple[str, ...]
    signature: str
    presigned: bool = False
    expires_s: int = 0

    @property
    def scope(self) -> str:
        return f"{self.date}/{self.region}/{self.service}/aws4_request"


def _query_pairs(raw_query: str) -> list[tuple[str, str]]:
    pairs = []
    for part in raw_query.split("&"):
        if part:
            key, _, value = part.partition("=")
            pairs.append((unquote(key), unquote(value)))
    return pairs


def parse(request: Request) -> Claim:
    """The claim a request makes, or SigV4Error (no signature at all: MissingAuthenticationToken)."""
    authorization = request.header("authorization")
    if authorization is not None:
        return _parse_header(authorization, request)
    query = dict(_query_pairs(request.raw_query))
    if "X-Amz-Signature" in query or "X-Amz-Algorithm" in query:
        return _parse_query(query)
    raise SigV4Error("MissingAuthenticationToken", "Request is missing Authentication Token")


def _parse_header(authorization: str, request: Request) -> Claim:
    algorithm, _, rest = authorization.strip().partition(" ")
    if algorithm != ALGORITHM:
        raise SigV4Error("IncompleteSignature", f"unsupported authorization algorithm {algorithm[:40]!r} "
                                                f"(only {ALGORITHM})")
    fields: dict[str, str] = {}
    for part in rest.split(","):
        key, _, value = part.strip().partition("=")
        fields[key] = value
    missing = [name for name in ("Credential", "SignedHeaders", "Signature") if not fields.get(name)]
    if missing:
        raise SigV4Error("IncompleteSignature", f"Authorization header lacks {', '.join(missing)}")
    amz_date = request.header("x-amz-date")
    if amz_date is None:
        raise SigV4Error("IncompleteSignature", "Authorization header requires existence of an X-Amz-Date header")
    return _claim(fields["Credential"], amz_date.strip(), fields["SignedHeaders"], fields["Signature"], False, 0)


def _parse_query(query: Mapping[str, str]) -> Claim:
    if query.get("X-Amz-Algorithm") != ALGORITHM:
        raise SigV4Error("IncompleteSignature", f"X-Amz-Algorithm must be {ALGORITHM}")
    missing = [name for name in ("X-Amz-Credential", "X-Amz-Date", "X-Amz-SignedHeaders", "X-Amz-Signature",
                                 "X-Amz-Expires") if not query.get(name)]
    if missing:
        raise SigV4Error("IncompleteSignature", f"a presigned request lacks {', '.join(missing)}")
    expires = query["X-Amz-Expires"]
    if not expires.isdigit() or not 1 <= int(expires) <= PRESIGNED_EXPIRES_MAX_S:
        raise SigV4Error("IncompleteSignature", f"X-Amz-Expires must be 1..{PRESIGNED_EXPIRES_MAX_S}")
    return _claim(query["X-Amz-Credential"], query["X-Amz-Date"], query["X-Amz-SignedHeaders"],
                  query["X-Amz-Signature"], True, int(expires))


def _claim(credential: str, amz_date: str, signed_headers: str, signature: str, presigned: bool,
           expires_s: int) -> Claim:
    match = _CREDENTIAL.fullmatch(credential)
    if match is None:
        raise SigV4Error("IncompleteSignature", "Credential must be <key>/<yyyymmdd>/<region>/sqs/aws4_request")
    key_id, date, region, service = match.groups()
    if service != SERVICE:
        raise SigV4Error("SignatureDoesNotMatch", f"Credential should be scoped to correct service: '{SERVICE}'")
    if not _AMZ_DATE.fullmatch(amz_date):
        raise SigV4Error("IncompleteSignature", "X-Amz-Date must be yyyymmddThhmmssZ")
    if amz_date[:8] != date:
        raise SigV4Error("SignatureDoesNotMatch", "Credential should be scoped to a valid date (that of X-Amz-Date)")
    names = tuple(signed_headers.split(";"))
    if "host" not in names or any(name != name.lower() or not name for name in names):
        raise SigV4Error("SignatureDoesNotMatch", "SignedHeaders must be lower-case and include host")
    if not _SIGNATURE.fullmatch(signature):
        raise SigV4Error("IncompleteSignature", "Signature must be 64 hexadecimal digits")
    return Claim(key_id, date, region, service, amz_date, names, signature, presigned, expires_s)


def check_time(claim: Claim, now_s: float) -> None:
    """X-Amz-Date within SKEW_MAX_S of now (a presigned request: not before, nor after its expiry)."""
    d = claim.amz_date          # yyyymmddThhmmssZ, checked by _claim (strptime cost more than the HMACs)
    try:
        signed_s = calendar.timegm((int(d[0:4]), int(d[4:6]), int(d[6:8]), int(d[9:11]), int(d[11:13]),
                                    int(d[13:15]), 0, 0, 0))
        datetime(int(d[0:4]), int(d[4:6]), int(d[6:8]), int(d[9:11]), int(d[11:13]), int(d[13:15]))   # a real date
    except ValueError:
        raise SigV4Error("IncompleteSignature", "X-Amz-Date is not a date") from None
    if claim.presigned:
        if now_s + SKEW_MAX_S < signed_s or now_s > signed_s + claim.expires_s:
            raise SigV4Error("SignatureDoesNotMatch", "Signature expired: the presigned request's time has passed")
        return
    if abs(now_s - signed_s) > SKEW_MAX_S:
        stamp = datetime.fromtimestamp(now_s, UTC).strftime("%Y%m%dT%H%M%SZ")
        raise SigV4Error("SignatureDoesNotMatch", f"Signature expired: {claim.amz_date} is now earlier or later "
                                                  f"than {stamp} by more than 15 minutes")


def _remove_dot_segments(path: str) -> str:
    out: list[str] = []
    for segment in path.split("/"):
        if segment == "..":
            if len(out) > 1:
                out.pop()
        elif segment != ".":
            out.append(segment)
    joined = "/".join(out)
    if not joined.startswith("/"):
        joined = "/" + joined
    if path.endswith(("/.", "/..")) and not joined.endswith("/"):
        joined += "/"
    return joined


def canonical_uri(raw_path: str) -> str:
    # Services other than S3 encode the path once more over what the client sent (AWS's
    # "each path segment URI-encoded twice"; botocore's quote(path, safe="/~")).
    return quote(_remove_dot_segments(raw_path or "/"), safe="/~")


def canonical_query(raw_query: str, presigned: bool) -> str:
    pairs = []
    for key, value in _query_pairs(raw_query):
        if presigned and key == "X-Amz-Signature":
            continue
        pairs.append((quote(key, safe="-_.~"), quote(value, safe="-_.~")))
    return "&".join(f"{key}={value}" for key, value in sorted(pairs))


def canonical_request(request: Request, claim: Claim) -> str:
    headers = []
    for name in claim.signed_headers:
        value = request.header(name)
        if value is None:
            raise SigV4Error("SignatureDoesNotMatch", f"signed header {name!r} is not in the request")
        headers.append(f"{name}:{' '.join(value.split())}\n")
    payload = hashlib.sha256(request.body).hexdigest()
    declared = request.header("x-amz-content-sha256")
    if declared is not None and declared != payload:
        # UNSIGNED-PAYLOAD, or a body that is not the one signed: the body must be covered.
        raise SigV4Error("SignatureDoesNotMatch", "X-Amz-Content-SHA256 does not match the body")
    return "\n".join([request.method.upper(), canonical_uri(request.raw_path),
                      canonical_query(request.raw_query, claim.presigned), "".join(headers),
                      ";".join(claim.signed_headers), payload])


def string_to_sign(request: Request, claim: Claim) -> str:
    digest = hashlib.sha256(canonical_request(request, claim).encode()).hexdigest()
    return "\n".join([ALGORITHM, claim.amz_date, claim.scope, digest])


@functools.lru_cache(maxsize=256)      # a key signs a day's requests in a region: four HMACs fewer each
def signing_key(secret: bytes, date: str, region: str, service: str) -> bytes:
    key = hmac.new(b"AWS4" + secret, date.encode(), hashlib.sha256).digest()
    for part in (region, service, "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    return key


def signature(request: Request, claim: Claim, secret: bytes) -> str:
    key = signing_key(secret, claim.date, claim.region, claim.service)
    return hmac.new(key, string_to_sign(request, claim).encode(), hashlib.sha256).hexdigest()


# Headers that decide what a request does or when it was made: sent, they must be signed, or
# whoever is on the path could change them under a valid signature (X-Amz-Target names the
# action of the JSON protocol: a captured PurgeQueue's body is also a valid DeleteQueue's).
MUST_BE_SIGNED = ("x-amz-target", "x-amz-date")


def verify(request: Request, claim: Claim, secret: bytes, now_s: float) -> None:
    """Raise SigV4Error unless `claim` is a valid signature of `request` by `secret`, made now."""
    for name in MUST_BE_SIGNED:
        if name not in claim.signed_headers and request.header(name) is not None:
            raise SigV4Error("SignatureDoesNotMatch", f"the header {name} is sent but not signed (SignedHeaders)")
    check_time(claim, now_s)
    expected = signature(request, claim, secret)
    if not hmac.compare_digest(expected, claim.signature):
        raise SigV4Error("SignatureDoesNotMatch", "The request signature we calculated does not match the signature "
                                                  "you provided. Check your AWS Secret Access Key and signing method.")
