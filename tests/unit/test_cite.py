"""``rootstock cite``: BibTeX from CHECKPOINT_INFO citations, with no network.

The install is made by hand (a built env's env_source.py and the manifest), so no
uv and no worker run.
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest

from rootstock.cli.main import main
from rootstock.install.layout import InstallLayout
from rootstock.install.manifest import ensure_manifest
from rootstock.ops.cite import cite
from rootstock.version import __version__

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("private_config")]

DOI = "10.1038/s42256-023-00716-3"
SOURCE = textwrap.dedent(
    f'''\
    """Checkpoints cited every way there is."""

    # /// script
    # requires-python = ">=3.11"
    # dependencies = ["ase>=3.23", "numpy"]
    # ///

    CHECKPOINTS = {{
        "paper-doi": "a",
        "paper_arxiv": "b",
        "paper-old-arxiv": "c",
        "no-paper": "d",
    }}

    CHECKPOINT_INFO = {{
        "paper-doi": {{"citation": "{DOI}", "licence": "MIT"}},
        "paper_arxiv": {{"citation": "arXiv:2401.00096v2"}},
        "paper-old-arxiv": {{"citation": "arXiv:cond-mat/0601001"}},
        "no-paper": {{"licence": "MIT"}},
    }}


    def setup(checkpoint, device="cuda", **kw):
        from ase.calculators.emt import EMT

        return EMT()
    '''
)


@pytest.fixture
def layout(tmp_path: Path) -> InstallLayout:
    """A root with the ``cited`` env built by hand (its env_source.py only)."""
    root = tmp_path / "root"
    made = InstallLayout(root, root)
    for directory in (made.environments_dir, made.envs_dir, made.cache_dir, made.home_dir):
        directory.mkdir(parents=True)
    ensure_manifest(made, ["testbox"])
    generation = made.envs_dir / ".cited.1700000000-abcdef"
    generation.mkdir()
    (generation / "env_source.py").write_text(SOURCE)
    made.env_dir("cited").symlink_to(generation.name)
    return made


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def entries(bibtex: str) -> dict[str, str]:
    """``{key: entry text}`` of every ``@type{key, ...}`` entry in ``bibtex``."""
    found = re.findall(r"^@(\w+)\{([^,]+),\n(.*?)^\}$", bibtex, re.S | re.M)
    return {key: f"@{kind}{{{key},\n{body}}}" for kind, key, body in found}


def fields(entry: str) -> dict[str, str]:
    return dict(re.findall(r"^  (\w+) = \{(.*)\},$", entry, re.M))


def test_a_doi_is_a_misc_entry_keyed_by_the_id_with_its_resolver_url(layout, capsys):
    code, out, err = run(capsys, "cite", "paper-doi", "--root", str(layout.root))
    assert (code, err) == (0, "")
    found = entries(out)
    assert set(found) == {"paper-doi", "rootstock"}
    assert found["paper-doi"].startswith("@misc{paper-doi,\n")
    assert fields(found["paper-doi"]) == {
        "doi": DOI,
        "url": f"https://doi.org/{DOI}",
        "note": "Machine-learned interatomic potential checkpoint paper-doi",
    }
    # Every brace balanced: a reference manager reads the whole entry.
    assert out.count("{") == out.count("}")


def test_an_arxiv_id_is_an_eprint_new_and_old_style(layout, capsys):
    code, out, _err = run(
        capsys, "cite", "paper_arxiv", "paper-old-arxiv", "--root", str(layout.root)
    )
    assert code == 0
    found = entries(out)
    assert list(found) == ["paper_arxiv", "paper-old-arxiv", "rootstock"]  # the order asked
    new = fields(found["paper_arxiv"])
    assert (new["eprint"], new["archivePrefix"]) == ("2401.00096v2", "arXiv")
    assert new["url"] == "https://arxiv.org/abs/2401.00096v2"
    assert "doi" not in new
    # The id's underscore is escaped where LaTeX typesets it, not in the key.
    assert new["note"].endswith(r"checkpoint paper\_arxiv")
    old = fields(found["paper-old-arxiv"])
    assert (old["eprint"], old["url"]) == (
        "cond-mat/0601001",
        "https://arxiv.org/abs/cond-mat/0601001",
    )


def test_rootstock_itself_is_always_cited_with_its_version(layout, capsys):
    code, out, _err = run(capsys, "cite", "paper-doi", "--root", str(layout.root))
    assert code == 0
    own = fields(entries(out)["rootstock"])
    assert own["title"].startswith("Rootstock")
    assert own["version"] == __version__


def test_a_checkpoint_without_a_citation_is_a_comment_not_an_error(layout, capsys):
    code, out, err = run(capsys, "cite", "no-paper", "paper-doi", "--root", str(layout.root))
    assert (code, err) == (0, "")
    comments = [line for line in out.splitlines() if line.startswith("%")]
    assert comments == ["% no-paper: no entry: its env file declares no citation (CHECKPOINT_INFO)"]
    assert set(entries(out)) == {"paper-doi", "rootstock"}


def test_an_unknown_id_is_one_error_with_close_matches_and_nothing_printed(layout, capsys):
    code, out, err = run(capsys, "cite", "paper-doi", "paper-dio", "--root", str(layout.root))
    assert code == 2 and out == ""
    first = err.splitlines()[0]
    assert first.startswith("error: unknown checkpoint 'paper-dio'"), err
    assert "paper-doi" in err  # the close match


def test_json_gives_the_entries_as_data(layout, capsys):
    code, out, _err = run(
        capsys, "cite", "paper-doi", "no-paper", "paper-doi", "--root", str(layout.root), "--json"
    )
    assert code == 0
    doc = json.loads(out)
    assert [e["checkpoint"] for e in doc] == ["paper-doi", "no-paper", None]  # each id once
    for entry in doc:
        assert set(entry) == {
            "checkpoint",
            "citation",
            "kind",
            "entry_type",
            "key",
            "fields",
            "bibtex",
        }
    doi, missing, own = doc
    assert (doi["kind"], doi["entry_type"], doi["key"], doi["citation"]) == (
        "doi",
        "misc",
        "paper-doi",
        DOI,
    )
    assert doi["fields"]["doi"] == DOI
    assert (missing["kind"], missing["key"], missing["fields"]) == (None, None, {})
    assert missing["bibtex"].startswith("% no-paper:")
    assert (own["kind"], own["key"], own["fields"]["version"]) == (
        "software",
        "rootstock",
        __version__,
    )


def test_the_operation_matches_the_command(layout):
    """The CLI only renders: the operation's BibTeX is what it prints."""
    (doi, own) = cite(layout, ["paper-doi"])
    assert doi["bibtex"] == (
        "@misc{paper-doi,\n"
        f"  doi = {{{DOI}}},\n"
        f"  url = {{https://doi.org/{DOI}}},\n"
        "  note = {Machine-learned interatomic potential checkpoint paper-doi},\n"
        "}"
    )
    assert own["key"] == "rootstock"
