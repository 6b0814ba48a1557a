"""docs/limits.md against the rows and the README: the limits quote the newest run, and say no less than the
README's table of what is tested.

At b0b1170 limits.md quoted a compiled ReFT step of 1.32 x the compiled LoRA step (6dbfb9d's run) after
3331f74's 0.985 x was stored, said ZeRO-3's throughput was not measured on GPUs after three runs at world
size 1 were, and said several machines were not tested where the README's table (and limits.md's own later
item) said CI runs two nodes on one machine.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_docs import passage
from test_readme import readme_table

ROOT = Path(__file__).parents[2]
LIMITS = ROOT / "docs" / "limits.md"

#: What limits.md quotes from the newest row of a results file: (file, the row's fields, the opening words of
#: the item that quotes it, the figure as the item writes it, formatted with the row's fields).
NEWEST = [
    ("compiled-1xH200.jsonl", {"provider": "pyvene_dist-compiled"}, "- **`torch.compile`**", "{ratio:.3f} x"),
    ("sharded-1xH200.jsonl", {"provider": "pyvene_dist", "strategy": "zero3"}, "- **ZeRO throughput**",
     "{ratio:.3f} x"),
]


@pytest.mark.parametrize("name, fields, opening, quoted", NEWEST, ids=[case[0] for case in NEWEST])
def test_the_limits_quote_the_newest_run(name, fields, opening, quoted):
    path = ROOT / "benchmarks" / "results" / name
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    matching = [row for row in rows if all(row.get(key) == value for key, value in fields.items())]
    assert matching, f"benchmarks/results/{name} has no row with {fields}"
    newest = quoted.format(**matching[-1])  # rows are appended as they are measured
    item = passage(LIMITS.read_text(), opening)
    assert newest in item, (f"docs/limits.md's {opening!r} does not quote the newest row of {name} "
                            f"({matching[-1]['commit']}): {newest}; it says: {item[:400]}")


#: The README's "What works" rows whose CI claim limits.md must not deny: (the row's strategy cell, the words by
#: which limits.md names the same thing).
CLAIMED = [("several nodes", ("several nodes", "several machines", "multi-node"))]


def denials(limits: str, readme: str) -> list[str]:
    """limits.md's items that call something "not tested" that the README's table says CI tests."""
    rows = {row["strategy"]: row["tested on"] for row in readme_table(readme)}
    found = []
    for strategy, names in CLAIMED:
        assert strategy in rows, f"README.md's What works table has no row {strategy!r}: update CLAIMED"
        if "(CI)" not in rows[strategy]:
            continue
        items = re.split(r"\n(?=- )", limits)
        found += [" ".join(item.split())[:120] for item in items if "not tested" in item
                  and any(name in item.lower() for name in names)]
    return found


def test_the_limits_do_not_deny_what_the_readme_says_ci_tests():
    assert denials(LIMITS.read_text(), (ROOT / "README.md").read_text()) == []


def test_a_denial_is_found():
    """b0b1170's item, planted in today's limits.md."""
    planted = LIMITS.read_text().replace("## Strategies\n", "## Strategies\n\n- **Several machines** (multi-node) "
                                                            "are not tested.\n", 1)
    assert denials(planted, (ROOT / "README.md").read_text()) == [
        "- **Several machines** (multi-node) are not tested."]
