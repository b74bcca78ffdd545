#!/bin/sh
# diagnose as a CI gate: fail the job when a run's log holds a finding at error or above.
#
#   sh examples/ci_gate.sh runs/own_module      # a run directory or a log file
#
# Exit status of `stabilizer diagnose`: 0 clean (below --fail-on), 1 a finding at or above it,
# 2 a usage error or an unreadable log. The report goes to stdout (--markdown for a PR comment).
set -u
stabilizer diagnose --fail-on "${FAIL_ON:-error}" "$@"
