"""Every name a run writes to metrics.jsonl and summary.json is documented in docs/outputs.md."""

import json

from tests.helpers import ROOT


def test_every_output_field_is_documented(straight):
    out, summary = straight
    doc = (ROOT / "docs" / "outputs.md").read_text()
    names = set(summary)
    for line in (out / "metrics.jsonl").read_text().splitlines():
        names |= set(json.loads(line))
    missing = sorted(n for n in names if f"`{n}`" not in doc)
    assert not missing, f"docs/outputs.md does not document {missing}"
    versions_row = next(line for line in doc.splitlines() if line.startswith("| `versions` |"))
    assert all(name in versions_row for name in summary["versions"]), (summary["versions"], versions_row)
