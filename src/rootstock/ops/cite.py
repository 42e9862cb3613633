"""``rootstock cite CHECKPOINT...``: BibTeX for checkpoints, and for Rootstock itself.

Each checkpoint's entry is built from its env file's ``CHECKPOINT_INFO`` citation
alone (a DOI or an arXiv id), never from the network: the entry carries the
identifier and its resolver URL, and a reference manager fills in the rest from
them. A checkpoint whose env file declares no citation gets no entry, only a note.
"""

from __future__ import annotations

import re
from importlib import metadata
from typing import TypedDict

from rootstock.install.envs import resolve_checkpoint
from rootstock.install.layout import InstallLayout
from rootstock.version import __version__

ROOTSTOCK_KEY = "rootstock"
ROOTSTOCK_TITLE = (
    "Rootstock: many machine-learned interatomic potentials from one ASE calculator, "
    "each in its own pre-built environment"
)
_DOI = re.compile(r"^10\.\d{4,9}/\S+$")
_ARXIV = re.compile(r"^arXiv:((?:\d{4}\.\d{4,5}|[a-z-]+(?:\.[A-Z]{2})?/\d{7})(?:v\d+)?)$")
# BibTeX keys may not hold spaces, commas, braces, quotes, '#', '%', '(', ')' or '='.
_KEY_UNSAFE = re.compile(r"[^A-Za-z0-9_:.+/-]")
# Characters LaTeX reads as commands in a text field (title, note); identifiers
# (doi, eprint, url) are left as they are, since biblatex reads those verbatim.
_LATEX_SPECIAL = re.compile(r"([_&%#$])")
# The project URLs to prefer, in order, when the package metadata declares several.
_URL_LABELS = ("homepage", "repository", "source", "documentation")


class Citation(TypedDict):
    """One entry of ``rootstock cite --json``: a checkpoint's (or Rootstock's) BibTeX."""

    #: The checkpoint id, or None for Rootstock's own entry.
    checkpoint: str | None
    #: What the env file declares as ``citation``, as written; None when it declares none.
    citation: str | None
    #: ``"doi"``, ``"arxiv"`` or ``"software"``; None when there is no entry to write.
    kind: str | None
    #: The BibTeX entry type (``"misc"``) and key, None without an entry.
    entry_type: str | None
    key: str | None
    #: The entry's fields in the order they are written.
    fields: dict[str, str]
    #: The entry as BibTeX text, or ``%`` comment lines saying why there is none.
    bibtex: str


def cite(
    layout: InstallLayout, checkpoints: list[str], cluster: str | None = None
) -> list[Citation]:
    """The citations of ``checkpoints`` (in the order given, each once), then Rootstock's.

    An id no installed env declares raises
    :class:`~rootstock.errors.CheckpointNotDeclared` (with close matches) before any
    entry is made.
    """
    infos = {
        checkpoint: resolve_checkpoint(layout, checkpoint, cluster).env.checkpoint_info.get(
            checkpoint, {}
        )
        for checkpoint in dict.fromkeys(checkpoints)
    }
    found = [checkpoint_citation(c, info.get("citation")) for c, info in infos.items()]
    return [*found, rootstock_citation()]


def checkpoint_citation(checkpoint: str, citation: str | None) -> Citation:
    """The entry for ``checkpoint`` cited as ``citation`` (a DOI or ``arXiv:`` id)."""
    key = _KEY_UNSAFE.sub("-", checkpoint)
    note = f"Machine-learned interatomic potential checkpoint {_latex_text(checkpoint)}"
    fields: dict[str, str]
    if citation is not None and _DOI.match(citation):
        kind = "doi"
        fields = {"doi": citation, "url": f"https://doi.org/{citation}", "note": note}
    elif citation is not None and (arxiv := _ARXIV.match(citation)):
        kind = "arxiv"
        eprint = arxiv.group(1)
        fields = {
            "eprint": eprint,
            "archivePrefix": "arXiv",
            "url": f"https://arxiv.org/abs/{eprint}",
            "note": note,
        }
    else:
        why = (
            "its env file declares no citation"
            if citation is None
            else f"its citation {citation!r} is neither a DOI nor an arXiv id"
        )
        return {
            "checkpoint": checkpoint,
            "citation": citation,
            "kind": None,
            "entry_type": None,
            "key": None,
            "fields": {},
            "bibtex": f"% {checkpoint}: no entry: {why} (CHECKPOINT_INFO)",
        }
    return {
        "checkpoint": checkpoint,
        "citation": citation,
        "kind": kind,
        "entry_type": "misc",
        "key": key,
        "fields": fields,
        "bibtex": bibtex_entry("misc", key, fields),
    }


def rootstock_citation() -> Citation:
    """Rootstock's own entry: its title and version, and its URL where the package
    metadata declares one."""
    fields = {"title": ROOTSTOCK_TITLE, "version": __version__, "note": f"Version {__version__}"}
    url = project_url()
    if url is not None:
        fields["url"] = url
    return {
        "checkpoint": None,
        "citation": None,
        "kind": "software",
        "entry_type": "misc",
        "key": ROOTSTOCK_KEY,
        "fields": fields,
        "bibtex": bibtex_entry("misc", ROOTSTOCK_KEY, fields),
    }


def project_url() -> str | None:
    """The URL the installed package's metadata declares (``[project.urls]``), if any."""
    try:
        urls = metadata.metadata("rootstock").get_all("Project-URL") or []
    except metadata.PackageNotFoundError:
        return None
    labelled: dict[str, str] = {}
    for item in urls:
        label, _, url = item.partition(",")
        labelled.setdefault(label.strip().lower(), url.strip())
    for label in _URL_LABELS:
        if labelled.get(label):
            return labelled[label]
    return next((url for url in labelled.values() if url), None)


def bibtex_entry(entry_type: str, key: str, fields: dict[str, str]) -> str:
    """``@type{key, field = {value}, ...}``, one field a line; braces in values are
    dropped, since an unbalanced one would end the entry."""
    lines = [f"@{entry_type}{{{key},"]
    for name, value in fields.items():
        clean = value.replace("{", "").replace("}", "")
        lines.append(f"  {name} = {{{clean}}},")
    lines.append("}")
    return "\n".join(lines)


def _latex_text(text: str) -> str:
    return _LATEX_SPECIAL.sub(r"\\\1", text)
