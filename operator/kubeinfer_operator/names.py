"""Kubernetes name and label syntax, and the child names derived from an InferenceModel's name.

The patterns are the API server's (k8s.io/apimachinery/pkg/util/validation): an InferenceModel may be
named like any custom resource (a DNS-1123 subdomain, up to 253 characters, dots allowed), but its
Service needs a DNS-1035 label (63 characters at most, a letter first, no dots). `child_name` maps
the first onto the second, so `llama-3.1-8b` or `7b-chat` deploy instead of failing at the Service.
"""

from __future__ import annotations

import hashlib
import re

# The same patterns appear in the CRD's CEL rules; keep them identical.
DNS1035_LABEL = r"[a-z]([-a-z0-9]*[a-z0-9])?"
DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS1123_SUBDOMAIN = rf"{DNS1123_LABEL}([.]{DNS1123_LABEL})*"
LABEL_VALUE = r"(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?"
QUALIFIED_NAME = rf"({DNS1123_SUBDOMAIN}/)?[A-Za-z0-9]([-A-Za-z0-9_.]{{0,61}}[A-Za-z0-9])?"

MAX_LABEL_LENGTH = 63
MAX_SUBDOMAIN_LENGTH = 253
_HASH_LENGTH = 8


def _full(pattern: str) -> re.Pattern[str]:
    return re.compile(f"^{pattern}$")


DNS1035_RE = _full(DNS1035_LABEL)
DNS1123_LABEL_RE = _full(DNS1123_LABEL)
DNS1123_SUBDOMAIN_RE = _full(DNS1123_SUBDOMAIN)
LABEL_VALUE_RE = _full(LABEL_VALUE)
QUALIFIED_NAME_RE = _full(QUALIFIED_NAME)


def is_dns1035_label(value: str) -> bool:
    return len(value) <= MAX_LABEL_LENGTH and DNS1035_RE.match(value) is not None


def is_dns1123_label(value: str) -> bool:
    return len(value) <= MAX_LABEL_LENGTH and DNS1123_LABEL_RE.match(value) is not None


def is_dns1123_subdomain(value: str) -> bool:
    return len(value) <= MAX_SUBDOMAIN_LENGTH and DNS1123_SUBDOMAIN_RE.match(value) is not None


def is_label_value(value: str) -> bool:
    return len(value) <= MAX_LABEL_LENGTH and LABEL_VALUE_RE.match(value) is not None


def is_qualified_name(value: str) -> bool:
    prefix, _, name = value.rpartition("/")
    if prefix and len(prefix) > MAX_SUBDOMAIN_LENGTH:
        return False
    return len(name) <= MAX_LABEL_LENGTH and QUALIFIED_NAME_RE.match(value) is not None


def child_name(name: str) -> str:
    """Name of every child object: `name` itself when it is a valid DNS-1035 label, else a sanitised
    form with an 8-hex-digit hash of the original appended (so `a.b` and `a-b` never collide).

    Returns a DNS-1035 label (<= 63 characters), which is also a valid label value and subdomain.
    """
    if is_dns1035_label(name):
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:_HASH_LENGTH]
    base = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    if not base or not base[0].isalpha():
        base = f"m-{base}".rstrip("-")
    base = base[: MAX_LABEL_LENGTH - _HASH_LENGTH - 1].rstrip("-")
    return f"{base}-{digest}"


def derived_name(base: str, suffix: str, max_length: int = MAX_LABEL_LENGTH) -> str:
    """`<base>-<suffix>` as a DNS-1035 label of at most `max_length` characters: the one way every
    secondary child (router, activator, loader Job, LeaderWorkerSet) is named.

    `base` is a child name (`child_name`: already a DNS-1035 label); `suffix` a DNS-1123 label. When the
    pair does not fit, `base` is cut and an 8-hex-digit hash of the whole of it is put before the suffix,
    so two long names that share a prefix keep distinct children. Raises ValueError for a suffix that
    leaves no room for a base."""
    if not DNS1123_LABEL_RE.match(suffix) or len(suffix) + 2 + _HASH_LENGTH > max_length:
        raise ValueError(f"suffix {suffix!r} cannot follow a child name within {max_length} characters")
    name = f"{base}-{suffix}"
    if len(name) <= max_length and is_dns1035_label(name):
        return name
    digest = hashlib.sha256(base.encode()).hexdigest()[:_HASH_LENGTH]
    room = max_length - len(suffix) - _HASH_LENGTH - 2
    head = base[:room].rstrip("-") or "m"
    return f"{head}-{digest}-{suffix}"
