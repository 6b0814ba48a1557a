#!/usr/bin/env bash
# Run pyvene's own test suite (from a pyvene checkout at the released tag) unpatched, then with
# pyvene_dist.patch() applied, and compare the outcomes test by test.
#   bash scripts/run_pyvene_tests.sh /path/to/pyvene   # a git checkout; its tests/ at tag v0.1.8 is used
# Tests that download models fail the same way both times on a machine without network access.
set -euo pipefail
checkout=$1
python=${PYTHON:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}
work=$(mktemp -d)
git -C "$checkout" archive v0.1.8 tests | tar -x -C "$work"
for mode in unpatched patched; do
  if [ "$mode" = patched ]; then printf 'import pyvene_dist\npyvene_dist.patch()\n' > "$work/conftest.py"; fi
  (cd "$work" && HF_HUB_OFFLINE=1 "$python" -m pytest -q -p no:cacheprovider -o python_files='*TestCase.py' -rA \
     tests/unit_tests tests/integration_tests > "$work/$mode.log" 2>&1 || true)
  grep -E "^(PASSED|FAILED|ERROR)" "$work/$mode.log" | sed 's/ - .*//' | sort > "$work/$mode.outcomes"
  echo "$mode: $(tail -1 "$work/$mode.log")"
done
if diff "$work/unpatched.outcomes" "$work/patched.outcomes"; then echo "same outcome for every test"; else exit 1; fi
