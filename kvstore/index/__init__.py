"""The page table (LMDB + overlays), checkpoints and recovery on open."""
