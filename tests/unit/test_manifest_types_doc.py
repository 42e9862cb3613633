"""docs/manifest.md and the manifest's TypedDicts name the same fields, record by record.

The field tables of the doc's "Fields" section are read (one table per heading, the
field names in backticks in the first column) and compared with each TypedDict's
keys, so a field added to one and not the other fails here with its name.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rootstock.install.manifest import types

DOC = Path(__file__).resolve().parents[2] / "docs" / "manifest.md"

# The heading (its start) of each record's table in docs/manifest.md.
SECTIONS: dict[str, type] = {
    "Top level": types.Manifest,
    "`envs[<env>]`": types.EnvRecord,
    "An env image": types.ImageRecord,
    "`envs[<env>].checkpoints[<id>]`": types.CheckpointRecord,
    "A weight file": types.WeightFile,
    "A verification record": types.Verification,
    "A fingerprint": types.Fingerprint,
    "A reference": types.Reference,
    "A build reference": types.BuildRef,
    "Physics checks": types.Checks,
    "One quantity": types.QuantityCheck,
}

_HEADING = re.compile(r"^#{3,4} (.+)$")
_FIELD_CELL = re.compile(r"`([^`]+)`")


def documented_fields(text: str) -> dict[str, set[str]]:
    """Each heading of the "Fields" section with the field names its table lists."""
    fields: dict[str, set[str]] = {}
    body = text.split("\n## Fields\n", 1)[1].split("\n## ", 1)[0]
    heading = None
    for line in body.splitlines():
        match = _HEADING.match(line)
        if match:
            heading = match.group(1)
            fields[heading] = set()
        elif heading and line.startswith("| `"):
            first_cell = line.split("|")[1]
            fields[heading].update(_FIELD_CELL.findall(first_cell))
    return fields


def keys_of(record: type) -> set[str]:
    """Every key a TypedDict declares, required or not."""
    return set(record.__required_keys__ | record.__optional_keys__)


def _section(documented: dict[str, set[str]], start: str) -> set[str]:
    matches = [heading for heading in documented if heading.startswith(start)]
    assert len(matches) == 1, f"docs/manifest.md needs one heading starting {start!r}: {matches}"
    return documented[matches[0]]


def field_mismatches(text: str) -> list[str]:
    """Every field in the types and not in the doc, or the other way round."""
    documented = documented_fields(text)
    problems = []
    for start, record in SECTIONS.items():
        in_doc, in_type = _section(documented, start), keys_of(record)
        for name in sorted(in_type - in_doc):
            problems.append(
                f"{record.__name__}.{name} is not documented under {start!r} in docs/manifest.md"
            )
        for name in sorted(in_doc - in_type):
            problems.append(
                f"docs/manifest.md documents {name!r} under {start!r}, "
                f"which {record.__name__} does not declare"
            )
    return problems


def test_every_record_type_has_a_section():
    assert set(SECTIONS.values()) == set(types.RECORD_TYPES)


def test_doc_and_types_name_the_same_fields():
    assert field_mismatches(DOC.read_text(encoding="utf-8")) == []


def test_a_field_missing_from_the_doc_is_named():
    text = DOC.read_text(encoding="utf-8").replace("| `natoms` |", "| natoms |")
    assert field_mismatches(text) == [
        "Fingerprint.natoms is not documented under 'A fingerprint' in docs/manifest.md"
    ]


def test_a_field_missing_from_the_types_is_named():
    text = DOC.read_text(encoding="utf-8").replace(
        "| `lock_hash` | str or null | As the env's `lock_hash`. |",
        "| `lock_hash` | str or null | As the env's `lock_hash`. |\n| `arch` | str | made up |",
    )
    assert field_mismatches(text) == [
        "docs/manifest.md documents 'arch' under 'A build reference', "
        "which BuildRef does not declare"
    ]


@pytest.mark.parametrize("start", ["A reference", "One quantity"])
def test_a_missing_section_is_refused(start):
    text = DOC.read_text(encoding="utf-8")
    heading = next(line for line in text.splitlines() if line.lstrip("#").strip().startswith(start))
    with pytest.raises(AssertionError, match=re.escape(start)):
        field_mismatches(text.replace(heading, "Some other text"))
