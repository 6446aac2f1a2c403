#!/usr/bin/env bash
# Checks, before `make` creates the venv, that the io_uring binding can be built:
# liburing 2024.5.3 ships as an sdist (Cython, with the C liburing bundled), so pip
# compiles it with the machine's C compiler against the Python headers.
set -euo pipefail
PYTHON=${PYTHON:-python3.11}
missing=()
if ! command -v "${CC:-cc}" >/dev/null 2>&1 && ! command -v gcc >/dev/null 2>&1; then
    missing+=("a C compiler (cc/gcc)")
fi
if ! "$PYTHON" - <<'PY' >/dev/null 2>&1
import os, sysconfig
raise SystemExit(0 if os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")) else 1)
PY
then
    missing+=("the Python headers (Python.h for $PYTHON)")
fi
if [ ${#missing[@]} -gt 0 ]; then
    echo "kvstore: cannot build the io_uring binding (liburing 2024.5.3): missing ${missing[*]}." >&2
    echo "  Debian/Ubuntu: apt-get install build-essential python3-dev" >&2
    echo "  Fedora/RHEL:   dnf install gcc python3-devel" >&2
    exit 1
fi
echo "kvstore: C toolchain found ($("${CC:-cc}" --version 2>/dev/null | head -1 || gcc --version | head -1))"
