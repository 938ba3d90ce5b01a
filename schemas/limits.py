"""Size limits of everything on the wire and in KV, checked before anything is decoded.

Every message is hostile until checked (DESIGN.md "Messaging contract"): its size is compared
with :data:`MAX_MESSAGE_BYTES` before a decoder sees it, and each string and list in
:mod:`schemas.messages` carries its own bound (Kubernetes' limits where Kubernetes has one), so
a record built from valid messages stays far below what the server accepts in one message.

Why these numbers: nats-server refuses a payload above its ``max_payload`` (1 MiB by default)
by closing the publisher's connection, so nothing Tandem writes may come near it. The largest
real message is a node's inventory snapshot (a 16-GPU + 16-NIC node with VFs is ~20 KB); the
largest record is a node's allocation record (at most one allocation per device, each a few
hundred bytes with bounded names). A dead letter carries only the first bytes of what was
refused, with its size and digest, so it is always small whatever arrived.
"""

from __future__ import annotations

import hashlib

# A message (any kind) on a Tandem subject; larger ones are dead-lettered undecoded.
MAX_MESSAGE_BYTES = 256 * 1024
# A KV record Tandem writes; a write that would exceed it is refused (the request that would
# grow a node's record past it is rejected with a reason instead of wedging the node).
MAX_RECORD_BYTES = 512 * 1024
# What a dead letter keeps of the refused bytes (enough to see what it was).
DEAD_LETTER_SAMPLE_BYTES = 2048

# Kubernetes' own limits (apimachinery validation): names are DNS subdomains, namespaces
# DNS labels, label keys an optional DNS-subdomain prefix plus a 63-character name.
K8S_NAME = 253
K8S_NAMESPACE = 63
K8S_UID = 128
LABEL_KEY = 317
LABEL_VALUE = 63
# A pod author's free-form texts (reasons, errors) and small lists.
TEXT = 4096
MAX_SELECTOR_TERMS = 64
MAX_ADDRESSES = 64
MAX_PROBLEMS = 256
MAX_DEVICES = 1024
# Pods in one job (a gang placed all-or-nothing; core.gang); fabric tiers configured.
MAX_JOB_PODS = 1024
MAX_FABRIC_TIERS = 8


def clip(text: str, limit: int = TEXT) -> str:
    """``text`` cut to ``limit`` characters (with a mark), for texts Tandem writes itself."""
    return text if len(text) <= limit else text[: limit - 15] + " ... (clipped)"


def digest(data: bytes) -> str:
    """The digest a dead letter names its refused payload by."""
    return "sha256:" + hashlib.sha256(data).hexdigest()
