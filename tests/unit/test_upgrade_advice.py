"""No message of ours tells anyone to ``pip install rootstock``.

The PyPI package called ``rootstock`` is an unrelated project: ``pip install -U
rootstock`` would replace this one with it. The upgrade hints name
:data:`rootstock.errors.UPGRADE_HINT` instead; every string in the source and every
command block in the docs is checked for the bare name.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from rootstock.errors import UPGRADE_HINT, LayoutError, ManifestError
from rootstock.install.layout import LAYOUT_VERSION, InstallLayout, read_layout
from rootstock.install.manifest import load_manifest

REPO = Path(__file__).resolve().parents[2]
# `pip install rootstock`, `pip install -U rootstock`, `pip install --upgrade rootstock`,
# but not `pip install 'rootstock[dashboard]'` (an extra of the installed package).
BARE_PIP_INSTALL = re.compile(r"pip3? install (?:-U |--upgrade )?rootstock(?![\[\w.-])")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)


def test_a_newer_layout_names_the_real_upgrade(tmp_path: Path) -> None:
    (tmp_path / "layout.json").write_text(
        json.dumps({"layout_version": LAYOUT_VERSION + 1, "cache_root": None})
    )
    with pytest.raises(LayoutError) as info:
        read_layout(tmp_path)
    assert UPGRADE_HINT in (info.value.hint or "")
    assert not BARE_PIP_INSTALL.search(str(info.value))


def test_a_newer_manifest_names_the_real_upgrade(tmp_path: Path) -> None:
    layout = InstallLayout(tmp_path, tmp_path)
    layout.manifest_file.write_text('{"schema_version": 99, "clusters": [], "envs": {}}\n')
    with pytest.raises(ManifestError) as info:
        load_manifest(layout)
    assert UPGRADE_HINT in (info.value.hint or "")
    assert not BARE_PIP_INSTALL.search(str(info.value))


def test_no_string_in_the_source_says_pip_install_rootstock() -> None:
    found = []
    for path in sorted((REPO / "src" / "rootstock").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            text = node.value if isinstance(node, ast.Constant) else None
            if isinstance(text, str) and BARE_PIP_INSTALL.search(text):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {text!r}")
    assert not found, "\n".join(found)


def test_no_command_in_the_docs_or_scripts_says_pip_install_rootstock() -> None:
    found = []
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    for page in pages:
        for block in FENCE.findall(page.read_text(encoding="utf-8")):
            found += [f"{page.relative_to(REPO)}: {m}" for m in BARE_PIP_INSTALL.findall(block)]
    for script in sorted((REPO / "scripts").rglob("*")):
        if script.is_file():
            text = script.read_text(encoding="utf-8", errors="replace")
            found += [f"{script.relative_to(REPO)}: {m}" for m in BARE_PIP_INSTALL.findall(text)]
    assert not found, "\n".join(found)
