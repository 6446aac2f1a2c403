"""Every file name in a store directory comes from here."""

from __future__ import annotations

import re
from pathlib import Path

SUPERBLOCK_NAME = "KVSTORE"
LOCK_NAME = "LOCK"
SEGMENTS_DIR = "segments"
WAL_DIR = "wal"
INDEX_DIR = "index"
CREATING_SUFFIX = ".creating"
# The tier manager's statistics (docs/format.md, "Tier manager statistics") and its
# temporary file during an atomic save.
TIERING_STATS_NAME = "tiering-stats.json"
TIERING_STATS_TMP_NAME = "tiering-stats.json.tmp"
# Left in a store `kvstore demo` created: the demo deletes and recreates only a store
# that holds it (any other store at its --path is refused unless --force).
DEMO_MARKER_NAME = "kvstore-demo"

_SEGMENT_RE = re.compile(r"^([0-9a-f]{16})\.seg$")
_WAL_RE = re.compile(r"^([0-9a-f]{16})\.wal$")


def segment_name(segment_id: int) -> str:
    return f"{segment_id:016x}.seg"


def wal_name(first_lsn: int) -> str:
    return f"{first_lsn:016x}.wal"


def parse_segment_name(name: str) -> int | None:
    match = _SEGMENT_RE.match(name)
    return int(match.group(1), 16) if match else None


def parse_wal_name(name: str) -> int | None:
    match = _WAL_RE.match(name)
    return int(match.group(1), 16) if match else None


def segment_path(root: Path, segment_id: int) -> Path:
    return root / SEGMENTS_DIR / segment_name(segment_id)


def wal_path(root: Path, first_lsn: int) -> Path:
    return root / WAL_DIR / wal_name(first_lsn)
