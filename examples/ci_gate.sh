#!/bin/sh
# diagnose as a CI gate: fail the job when a run's log holds a finding at error or above.
#
#   sh examples/ci_gate.sh runs/own_module      # a run directory or a log file
#
# Exit status of `stabilizer diagnose`: 0 clean (below --fail-on), 1 a finding at or above it,
# 2 a usage error or an unreadable log. The report goes to stdout (--markdown for a PR comment).
# The command is the one on PATH (a CI job that pip-installed stabilizer), else the one `make`
# installed in this repository's .venv: the venv need not be activated.
set -u
here=$(dirname "$0")
if command -v stabilizer >/dev/null 2>&1; then
    stabilizer=stabilizer
elif [ -x "$here/../.venv/bin/stabilizer" ]; then
    stabilizer="$here/../.venv/bin/stabilizer"
else
    echo "ci_gate.sh: no stabilizer command: run make (or pip install -e .) first" >&2
    exit 2
fi
"$stabilizer" diagnose --fail-on "${FAIL_ON:-error}" "$@"
