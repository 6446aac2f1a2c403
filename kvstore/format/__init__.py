"""On-disk formats: pure bytes <-> values, no I/O. Specified in docs/format.md."""

from kvstore.format.constants import BLOCK_BYTES, FORMAT_VERSION, align_up, record_span

__all__ = ["BLOCK_BYTES", "FORMAT_VERSION", "align_up", "record_span"]
