"""Segment files (page records) and the write-ahead log."""
