#!/usr/bin/env bash
# The README's blocks as written, with real installs, in a fresh virtualenv per stack.
#
# The suite runs the README's blocks in its own virtualenv, with installs checked instead
# of run (tests/docs/runner.py). This runs them for real: a fresh virtualenv with the
# stack installed from this checkout (plus pytest, to drive the blocks), then the
# README's blocks with DOCS_SNIPPETS_REAL_INSTALL=1 (the main job's `python3.11 -m venv
# .venv && .venv/bin/pip install ...` creates and fills another fresh virtualenv in the
# scratch directory). Slow (installs verifiers twice per stack); not part of .ci/run.
#
#   bash tests/docs/fresh_venv.sh [v1|classic ...]   (default: both)
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-python3.11}"
stacks=("$@")
[ ${#stacks[@]} -eq 0 ] && stacks=(v1 classic)
status=0
for stack in "${stacks[@]}"; do
    scratch=$(mktemp -d)
    trap 'rm -rf "$scratch"' EXIT
    echo "=== $stack: fresh virtualenv $scratch/venv" >&2
    "$PYTHON" -m venv "$scratch/venv"
    "$scratch/venv/bin/pip" install -q --upgrade pip
    "$scratch/venv/bin/pip" install -q -e ".[$stack,test]"
    DOCS_SNIPPETS_REAL_INSTALL=1 "$scratch/venv/bin/python" -m pytest -v -rs -p no:cacheprovider \
        tests/docs/test_snippets.py -k README || status=1
    rm -rf "$scratch"
    trap - EXIT
done
exit $status
