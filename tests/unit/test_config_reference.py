"""docs/config_reference.md is what mcit.core.config_reference generates from the models now, and every key of a
run config and of each method's parameters says what it is."""

from __future__ import annotations

from conftest import ROOT

from mcit.core import config_reference as R


def test_the_config_reference_is_current():
    assert (ROOT / "docs" / "config_reference.md").read_text() == R.generate(), \
        "docs/config_reference.md is stale: python -m mcit.core.config_reference --write"


def test_every_key_is_described_with_its_type_and_default():
    """Every key of a run config and of every method's own parameters."""
    text = R.generate()
    rows = [ln for ln in text.splitlines() if ln.startswith("| `")]
    assert len(rows) > 300
    bare = [ln.split(" | ")[0] for ln in rows if ln.rstrip().endswith("|  |")]
    assert not bare, f"keys without a description: {bare}"
    assert "| `train.optimizer` | one of: adam, adamw, sgd | `'adam'` |" in text
    assert "| `log.report_to` | list[str] \\| str | `'none'` |" in text
    for method in ("fwd_prompt", "norga", "l2p", "lora"):
        assert f"### `method.name: {method}`" in text
