"""Opaque text for a job spec: settings a worker needs that its reader should not see plainly.

The launcher writes every job's config where its user can read it (``labkit_home()/runs``).
The capstone's job (notebook 07) must not show its settings there: they would name the faults
the learner is asked to find. :func:`seal` turns a JSON value into a text that names nothing;
the worker opens it with :func:`unseal`. A seal, not encryption: anyone who reads this module
can open one by hand, and nothing depends on that not happening (the capstone's check grades
what a learner's changes do to the job, measured). No labkit imports: workers open seals.
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
from typing import Any


def _stream(nonce: bytes, n: int) -> bytes:
    out, block = b"", 0
    while len(out) < n:
        out += hashlib.sha256(b"labkit-capstone-spec" + nonce + block.to_bytes(4, "big")).digest()
        block += 1
    return out[:n]


def seal(obj: Any) -> str:
    """``obj`` (JSON) as an opaque text: no name or value in plain form."""
    body = json.dumps(obj, sort_keys=True).encode()
    nonce = secrets.token_bytes(8)
    return base64.b64encode(nonce + bytes(a ^ b for a, b in zip(body, _stream(nonce, len(body)),
                                                              strict=True))).decode()  # fmt: skip


def unseal(text: str) -> Any:
    """The JSON value :func:`seal` turned into ``text``."""
    raw = base64.b64decode(text)
    nonce, body = raw[:8], raw[8:]
    return json.loads(bytes(a ^ b for a, b in zip(body, _stream(nonce, len(body)), strict=True)))
