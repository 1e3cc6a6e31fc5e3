#!/usr/bin/env bash
# The device check: one command for a short, offline GPU session (see scripts/device_check.py for the steps).
#   scripts/device_check.sh              on the GPU machine: results in $OUT (./device-results where unset)
#   scripts/device_check.sh --dry-run    on CPU: the same steps at tiny shapes under TRITON_INTERPRET=1
# It stops itself within its deadline (--deadline-s, default 450 s; each step has its own timeout) and exits 1
# when a step failed, after writing the summary. PYTHON picks the interpreter (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" scripts/device_check.py "$@"
