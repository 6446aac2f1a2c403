"""Test support for kvstore's reliability suite and tools; not part of the store.

``faults`` records the file-system calls a store makes and rebuilds the disk
as a power cut could have left it; it also fails the Nth I/O on demand.
``powerloss`` drives workloads against an oracle kept outside the store, and
``powerloss_cli`` is tools/powerloss.py's command line over it and ``ioerrors``.
``crashloop`` (with ``crashloop_fsck``), ``corruption``, ``readers`` (with
``reader_soak``), ``tier_crash``, ``tier_soundness``, ``gpu_tier_sound`` and
``sim_identity`` are the drivers behind the tools of the same names.
Nothing in ``kvstore`` proper imports this package.
"""
