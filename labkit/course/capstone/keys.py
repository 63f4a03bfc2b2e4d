"""Who can know a capstone job's faults: the instructor's key, the learner's job code, the seal.

A seed alone plants nothing: which faults a seed plants (:func:`labkit.course.capstone.plan`) is an
HMAC-SHA256 of (course version, tier, seed, level) under a secret that only the instructor's
**key file** holds (:func:`create`, :func:`load`; ``python -m labkit capstone new`` makes one,
mode 0600, under ``labkit_home()/capstone/key.json`` or where ``--key`` says). With the key file
the instructor turns a learner's code (``capstone reveal --job CODE``) or a seed and level back
into its answer key; without it, the seed says nothing about the faults, and neither do the
run object's fields or the files the job writes. The job code does hold them, sealed (below):
the learner's record of attempts works on trust.

The learner's machine must still plant the faults, so the learner gets a **job code**
(:func:`code_for`): ``cpu-1234-d22vgd54``, the tier, the seed and the plan **sealed**. Opening
the seal on purpose is giving up (``python -m labkit capstone reveal --give-up``), which the
learner's attempt record keeps (:mod:`labkit.course.capstone.attempts`). A seal is not encryption:
labkit itself opens it to plant the faults, so someone who reads this module can open it by
hand. Nothing depends on that not happening: the capstone's check grades what the learner's
changes do to the job, measured, and never says which faults were planted, so an opened seal
buys what giving up buys and no more. The same holds for the job's own files: the launcher's
job spec carries the worker's settings sealed (:func:`labkit.course.sealed.seal`), not as fault names or plain
values.

A self-paced learner needs no instructor: :func:`labkit.course.capstone.new_job` draws a job with a
one-off secret that is never stored, so only its sealed code can say what it plants.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from labkit import __version__
from labkit.errors import LabkitError

VERSION = __version__
"""The course version a key file and a job code belong to: another version may plant
differently, so a key or a code of another version is refused by name."""
FORMAT = "labkit-capstone-key"
SECRET_BYTES = 32
MASK_BYTES = 3  # a job code holds one bit per fault of the catalogue: room for 24


class CapstoneKeyError(ValueError, LabkitError):
    """A key file or a job code the capstone cannot use; the message names the fix."""


def default_key_path() -> Path:
    from labkit.jobs.procs import labkit_home

    return labkit_home() / "capstone" / "key.json"


@dataclass(frozen=True)
class Key:
    """The instructor's secret (never printed, never in a repr) and where it came from."""

    secret: bytes
    path: Path | None
    version: str = VERSION

    def __repr__(self) -> str:
        return f"Key(path={str(self.path)!r}, version={self.version!r})"

    def digest(self, tier: str, seed: int, level: str) -> bytes:
        """HMAC-SHA256 of (course version, tier, seed, level) under this key: what a seed's plan
        draws from."""
        msg = f"labkit-capstone|{self.version}|{tier}|{seed}|{level}".encode()
        return hmac.new(self.secret, msg, hashlib.sha256).digest()


def one_off() -> Key:
    """A secret drawn now and never stored: a self-paced learner's job."""
    return Key(secrets.token_bytes(SECRET_BYTES), None)


def create(path: str | Path | None = None) -> tuple[Key, bool]:
    """The key file at ``path`` (default :func:`default_key_path`), made now with a fresh
    secret and mode 0600 if there is none; (the key, whether it was made now)."""
    path = Path(path) if path is not None else default_key_path()
    if path.exists():
        return load(path), False
    path.parent.mkdir(parents=True, exist_ok=True)
    body = json.dumps({"format": FORMAT, "course_version": VERSION,
                       "secret": secrets.token_bytes(SECRET_BYTES).hex()})  # fmt: skip
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(body + "\n")
    return load(path), True


def load(path: str | Path | None = None) -> Key:
    """The key file at ``path`` (default :func:`default_key_path`); a missing, corrupt or other
    version's file is refused with what to do."""
    path = Path(path) if path is not None else default_key_path()
    if not path.exists():
        raise CapstoneKeyError(
            f"no capstone key file at {path}: the instructor's key is made by "
            "`python -m labkit capstone new` (on the instructor's machine), or give its path "
            "with --key PATH. A learner without an instructor opens their own job with "
            "`python -m labkit capstone reveal --give-up`")  # fmt: skip
    try:
        data = json.loads(path.read_text())
        secret = bytes.fromhex(data["secret"])
        version = data["course_version"]
        if data.get("format") != FORMAT or len(secret) != SECRET_BYTES or not isinstance(version, str):
            raise ValueError("not a labkit capstone key")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CapstoneKeyError(
            f"{path} is not a usable capstone key file ({type(err).__name__}: {err}): restore it "
            "from your copy; a new key (`python -m labkit capstone new --key NEW_PATH`) plants "
            "other faults for the same seeds, so the learners' codes need re-issuing") from None  # fmt: skip
    if version != VERSION:
        raise CapstoneKeyError(
            f"{path} is a key of course version {version}, and this labkit is {VERSION}: seeds "
            f"plant differently across versions. Reveal with labkit {version}, or make a key "
            f"for {VERSION} (`python -m labkit capstone new --key NEW_PATH`) and re-issue the "
            "job codes")  # fmt: skip
    return Key(secret, path, version)


# --------------------------------------------------------------------------- job codes


def _pad(tier: str, seed: int, n: int) -> bytes:
    return hashlib.sha256(f"labkit-capstone-seal|{VERSION}|{tier}|{seed}".encode()).digest()[:n]


def _check(tier: str, seed: int, mask: int) -> bytes:
    return hashlib.sha256(f"labkit-capstone-code|{VERSION}|{tier}|{seed}|{mask}".encode()).digest()[:2]


def code_for(faults: list[str] | tuple[str, ...], tier: str, seed: int) -> str:
    """The job code a learner types: the tier, the seed, and ``faults`` sealed."""
    from labkit.course.capstone.faults import BY_ID, TIERS

    if tier not in TIERS:
        raise ValueError(f"tier={tier!r} is not allowed: one of {TIERS}")
    ids = list(BY_ID)
    mask = sum(1 << ids.index(f) for f in faults)
    body = mask.to_bytes(MASK_BYTES, "big")
    sealed = bytes(a ^ b for a, b in zip(body, _pad(tier, seed, MASK_BYTES), strict=True))
    text = base64.b32encode(sealed + _check(tier, seed, mask)).decode().rstrip("=").lower()
    return f"{tier}-{seed}-{text}"


@dataclass(frozen=True)
class Code:
    """A job code read back: tier and seed in plain; the faults only for whoever opens it."""

    text: str
    tier: str
    seed: int
    _mask: int

    def __repr__(self) -> str:
        return f"Code({self.text!r})"

    def open(self) -> tuple[str, ...]:
        """The faults this code plants: what giving up shows (and what the job plants)."""
        from labkit.course.capstone.faults import BY_ID

        return tuple(f for i, f in enumerate(BY_ID) if self._mask >> i & 1)


def _shown_code(text: str) -> str:
    """A job code as a message names it: whole, or its start and length when far too long."""
    text = text.strip()
    return repr(text) if len(text) <= 60 else f"{text[:40]!r}… ({len(text)} characters)"


def read_code(text: object, tier: str | None = None) -> Code:
    """``text`` as a job code; a typo, another course version's code, or (with ``tier``) a code
    for another tier is refused with what to do."""
    from labkit.course.capstone.faults import BY_ID, LEVELS, SEED_DIGITS, available, shown_seed

    fresh = "or leave the job code empty for a fresh job of your own"
    if isinstance(text, int) and not isinstance(text, bool) and text.bit_length() <= 64:
        text = str(text)  # a seed typed as a number: named as one below
    if not isinstance(text, str):
        raise CapstoneKeyError(f"job code {shown_seed(text)} is not allowed: a text like "
                               f"'cpu-1234-d22vgd54' (your instructor's, {fresh})")  # fmt: skip
    parts = text.strip().rsplit("-", 2)
    shown = _shown_code(text)
    bad = (f"job code {shown} is not one this labkit ({VERSION}) made: check it for a typo, "
           f"ask your instructor for a code of this course version, {fresh}")
    # a seed past SEED_DIGITS is no seed a code was made with (and int() refuses 4300 digits)
    if len(parts) != 3 or not parts[1].isdecimal() or len(parts[1]) > SEED_DIGITS:
        if text.strip().isdecimal():
            raise CapstoneKeyError(
                f"{shown} is a seed, not a job code: a seed alone plants nothing any more. "
                "Your instructor's `python -m labkit capstone new --seed N` prints the job "
                f"code for it ('cpu-N-…'), {fresh}")  # fmt: skip
        raise CapstoneKeyError(bad)
    code_tier, seed, rest = parts[0], int(parts[1]), parts[2]
    try:
        raw = base64.b32decode(rest.upper() + "=" * (-len(rest) % 8))
    except ValueError:
        raise CapstoneKeyError(bad) from None
    if len(raw) != MASK_BYTES + 2:
        raise CapstoneKeyError(bad)
    pad = _pad(code_tier, seed, MASK_BYTES)
    mask = int.from_bytes(bytes(a ^ b for a, b in zip(raw[:MASK_BYTES], pad, strict=True)), "big")
    if not hmac.compare_digest(raw[MASK_BYTES:], _check(code_tier, seed, mask)) or mask >> len(BY_ID):
        raise CapstoneKeyError(bad)
    code = Code(text.strip(), code_tier, seed, mask)
    known = {f.id for f in available(code_tier)} if code_tier in {"cpu", "single-gpu", "multi-gpu"} else set()
    counts = {count for count, _ in LEVELS.values()}
    if not known or len(code.open()) not in counts or not set(code.open()) <= known:
        raise CapstoneKeyError(bad)
    if tier is not None and code_tier != tier:
        raise CapstoneKeyError(
            f"job code {code.text!r} is a job for the {code_tier} tier, and this machine runs "
            f"notebook 07's job on the {tier} tier (the faults each tier can plant differ): ask "
            f"your instructor for a {tier} code (`python -m labkit capstone new --tier {tier}`), "
            f"{fresh}")  # fmt: skip
    return code
