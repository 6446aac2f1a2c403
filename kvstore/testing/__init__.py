"""Test support for kvstore's reliability suite and tools; not part of the store.

``faults`` records the file-system calls a store makes and rebuilds the disk
as a power cut could have left it; it also fails the Nth I/O on demand.
``powerloss`` drives workloads against an oracle kept outside the store.
Nothing in ``kvstore`` proper imports this package.
"""
