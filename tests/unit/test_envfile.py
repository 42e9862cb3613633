"""Env-file parsing and lint: the malformed corpus, the samples, and id conflicts.

Every file in ``tests/envs/malformed/`` breaks exactly one rule and must be
rejected with its own message, on the right line, naming the fix.
"""

from __future__ import annotations

import functools
import textwrap
from pathlib import Path

import pytest

from rootstock.errors import EnvFileError
from rootstock.install.envfile import (
    EnvFile,
    LintProblem,
    id_conflicts,
    parse_env_file,
    read_env_file,
    source_hash,
)

pytestmark = pytest.mark.timeout(30)

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "environments"
AURORA = REPO / "aurora_configs"
MALFORMED = REPO / "tests" / "envs" / "malformed"

# file stem -> (line of the problem, a substring only its own message contains)
EXPECTED = {
    "syntax-error": (13, "syntax error: expected ':'"),
    "no-script-block": (1, "no PEP 723 metadata block"),
    "unclosed-script-block": (3, "block is never closed"),
    "two-script-blocks": (8, "more than one '# /// script' block"),
    "invalid-toml": (3, "block cannot be read: invalid TOML"),
    "no-dependencies": (3, "block needs dependencies"),
    "rootstock-dependency": (3, "rootstock is not installed by name"),
    "requires-python-not-string": (3, "requires-python must be a string"),
    "no-checkpoints": (1, "no module-level CHECKPOINTS table"),
    "empty-checkpoints": (8, "CHECKPOINTS is empty"),
    "checkpoints-not-dict": (8, "CHECKPOINTS is a list; it must be a dict"),
    "no-setup": (1, "no top-level setup() function"),
    "setup-without-device": (13, "setup() accepts no device argument"),
    "setup-without-checkpoint": (13, "setup() takes no checkpoint argument"),
    "setup-from-path-without-path": (20, "setup_from_path() takes no path argument"),
    "evaluate-batch-without-properties": (19, "evaluate_batch() takes 2 positional argument(s)"),
    "checkpoints-not-literal": (9, "CHECKPOINTS is not a literal"),
    "verify-kwargs-not-literal": (13, "VERIFY_KWARGS is not a literal"),
    "custom-without-setup-from-path": (10, "takes user weights but there is no setup_from_path"),
    "verify-kwargs-unknown-id": (13, "VERIFY_KWARGS names 'toy-2', which CHECKPOINTS does not"),
    "verify-kwargs-not-dict": (12, "VERIFY_KWARGS must be a dict {checkpoint-id"),
    "verify-kwargs-value-not-dict": (13, "VERIFY_KWARGS['toy-1'] must be a dict of keyword"),
    "verify-kwargs-not-json": (13, "JSON cannot carry"),
    "verify-checks-unknown-id": (13, "VERIFY_CHECKS declares checks for 'toy-2', an id"),
    "verify-checks-unknown-key": (15, "checks an unknown quantity 'force'"),
    "verify-checks-unknown-mode": (14, "VERIFY_CHECKS['toy-1']['forces'] is 'predicted'"),
    "verify-checks-not-dict": (12, "VERIFY_CHECKS must be a dict {checkpoint-id"),
    "verify-checks-value-not-dict": (13, "VERIFY_CHECKS['toy-1'] must be a dict {quantity"),
    "empty-clusters": (12, "CLUSTERS is empty"),
    "clusters-not-list": (12, "CLUSTERS must be a list of cluster names"),
    "duplicate-id-of-emt": (10, "'emt' is already declared by the installed env 'emt'"),
    "bad-checkpoint-id": (10, "checkpoint id 'toy model' is not allowed"),
    "checkpoint-value-none": (10, "CHECKPOINTS['toy-2'] is None; it must be a string"),
    "custom-value-not-string": (10, "CHECKPOINTS['toy:custom'] must be None or a string"),
    "empty-upstream": (10, "CHECKPOINTS['toy-2'] is an empty string"),
    "duplicate-key": (10, "CHECKPOINTS repeats the key 'toy-1'"),
    "assigned-twice": (12, "CHECKPOINTS is assigned again (first on line 8)"),
    "changed-after-literal": (12, "CHECKPOINTS is changed after its top-level literal"),
    "updated-at-import": (12, "CHECKPOINTS.update() changes CHECKPOINTS at import time"),
    "defined-in-block": (13, "VERIFY_KWARGS is defined inside a block"),
    "verify-structure-not-dict": (12, "VERIFY_STRUCTURE must be a dict"),
    "verify-structure-unknown-key": (12, "VERIFY_STRUCTURE has unknown keys ['positons']"),
    "verify-structure-bad-symbol": (12, "symbols are missing or not chemical elements"),
    "verify-structure-positions-mismatch": (12, "positions must be 2 [x, y, z] rows"),
    "verify-structure-bad-cell": (12, "VERIFY_STRUCTURE cell must be 3 rows"),
    "verify-structure-bad-pbc": (12, "VERIFY_STRUCTURE pbc must be True, False"),
    "verify-structure-periodic-without-cell": (12, "is periodic but has no cell"),
    "_bad-env-name": (1, "env name '_bad-env-name' (from the file name) is not allowed"),
    "checkpoint-info-not-dict": (12, "CHECKPOINT_INFO must be a dict {checkpoint-id"),
    "checkpoint-info-unknown-id": (13, "CHECKPOINT_INFO describes 'toy-2', an id CHECKPOINTS"),
    "checkpoint-info-value-not-dict": (13, "CHECKPOINT_INFO['toy-1'] must be a dict {field"),
    "checkpoint-info-bad-licence": (15, "'MIT License', not an SPDX id"),
    "checkpoint-info-bad-gated": (14, "['gated'] must be None or the URL where access"),
    "checkpoint-info-bad-citation": (15, "'Toy et al. 2024', neither a DOI nor an arXiv id"),
    "checkpoint-info-not-string": (14, "['training_data'] is 42; it must be a non-empty string"),
}

# The rules the issue requires, each with the corpus file that breaks it.
REQUIRED_RULES = {
    "syntax error": "syntax-error",
    "missing PEP 723 block": "no-script-block",
    "missing CHECKPOINTS": "no-checkpoints",
    "missing setup": "no-setup",
    "non-literal tables": "checkpoints-not-literal",
    ":custom without setup_from_path": "custom-without-setup-from-path",
    "VERIFY_KWARGS key not declared": "verify-kwargs-unknown-id",
    "VERIFY_CHECKS key not declared": "verify-checks-unknown-id",
    "VERIFY_CHECKS unknown quantity": "verify-checks-unknown-key",
    "VERIFY_CHECKS unknown mode": "verify-checks-unknown-mode",
    "empty CLUSTERS": "empty-clusters",
    "id declared by another installed env": "duplicate-id-of-emt",
    "id outside the allowed pattern": "bad-checkpoint-id",
    "CHECKPOINTS value not a string": "checkpoint-value-none",
    "evaluate_batch with the wrong signature": "evaluate-batch-without-properties",
    "CHECKPOINT_INFO key not declared": "checkpoint-info-unknown-id",
    "CHECKPOINT_INFO field of the wrong type": "checkpoint-info-not-string",
}


@functools.cache
def sample_envs() -> tuple[EnvFile, ...]:
    """The shipped sample envs, standing in for an install's built envs."""
    return tuple(read_env_file(path) for path in sorted(SAMPLES.glob("*.py")))


def corpus_problems(stem: str) -> list[LintProblem]:
    """Everything ``install`` would report for one corpus file."""
    env, problems = parse_env_file(MALFORMED / f"{stem}.py")
    return problems + id_conflicts(env, list(sample_envs()))


def write_env(directory: Path, name: str, body: str) -> Path:
    """A valid env file named ``name`` with ``body`` (tables) spliced in."""
    path = directory / f"{name}.py"
    path.write_text(
        '"""A test env."""\n\n'
        "# /// script\n"
        '# requires-python = ">=3.11"\n'
        '# dependencies = ["ase>=3.23"]\n'
        "# ///\n\n"
        + textwrap.dedent(body).strip()
        + '\n\n\ndef setup(checkpoint, device="cuda", **kw):\n'
        "    from ase.calculators.emt import EMT\n\n"
        "    return EMT()\n"
    )
    return path


# --- the malformed corpus -------------------------------------------------------------


def test_corpus_is_complete():
    on_disk = {p.stem for p in MALFORMED.glob("*.py")}
    assert on_disk == set(EXPECTED), "every corpus file needs an entry in EXPECTED"
    assert len(on_disk) >= 18
    assert set(REQUIRED_RULES.values()) <= on_disk


@pytest.mark.parametrize("stem", sorted(EXPECTED))
def test_malformed_file_is_rejected_with_its_own_message(stem):
    line, needle = EXPECTED[stem]
    problems = corpus_problems(stem)
    assert len(problems) == 1, [str(p) for p in problems]
    (problem,) = problems
    assert needle in problem.message
    assert problem.line == line
    text = str(problem)
    assert text.startswith(f"{MALFORMED / stem}.py:{line}: ")
    assert text.endswith(")") and "(fix: " in text
    assert problem.fix.strip()


def test_each_message_is_distinct():
    messages = {stem: corpus_problems(stem)[0].message for stem in EXPECTED}
    for stem, (_, needle) in EXPECTED.items():
        owners = [other for other, message in messages.items() if needle in message]
        assert owners == [stem], f"{needle!r} matches {owners}"


@pytest.mark.parametrize("stem", sorted(set(EXPECTED) - {"duplicate-id-of-emt"}))
def test_read_env_file_raises_with_the_problem(stem):
    with pytest.raises(EnvFileError) as caught:
        read_env_file(MALFORMED / f"{stem}.py")
    error = caught.value
    assert len(error.problems) == 1
    assert EXPECTED[stem][1] in str(error)
    assert "docs/environments.md" in str(error)


def test_unreadable_file_names_the_fix(tmp_path):
    path = tmp_path / "latin1.py"
    path.write_bytes(b'"""caf\xe9"""\n')
    with pytest.raises(EnvFileError) as caught:
        parse_env_file(path)
    assert str(path) in str(caught.value)
    assert "UTF-8" in caught.value.hint


# --- the samples ----------------------------------------------------------------------


def test_every_sample_passes_the_lint_and_conflicts_with_none():
    envs = sample_envs()
    assert {e.name for e in envs} >= {"emt", "chgnet", "sevennet", "mace", "uma", "orb"}
    for env in envs:
        assert env.requires_python == ">=3.11", env.name
        assert id_conflicts(env, list(envs)) == [], env.name


def test_samples_are_production_shaped():
    """Plain torch, no CPU pin, no local paths: tests add those at build time."""
    for env in sample_envs():
        for dep in env.dependencies:
            assert "+cpu" not in dep and "file:" not in dep and "/" not in dep, (env.name, dep)
        if env.name != "emt":
            assert "torch" in env.dependencies, env.name
        assert "tool" not in env.script_metadata, env.name


@pytest.mark.parametrize("name", ["chgnet", "sevennet", "mace", "orb", "tensornet", "uma"])
def test_every_family_sample_takes_user_weights(name):
    """Every family can load a user's own fine-tune through ``<family>:custom``."""
    env = read_env_file(SAMPLES / f"{name}.py")
    assert env.has_setup_from_path
    assert f"{name}:custom" in env.checkpoints


def test_emt_sample():
    env = read_env_file(SAMPLES / "emt.py")
    assert env.declared_ids() == ["emt"]
    assert env.functions == {"setup"}
    assert not env.is_variant and env.verify_kwargs == {}
    assert [d.split(">")[0] for d in env.dependencies] == ["ase", "numpy"]


def test_chgnet_sample():
    env = read_env_file(SAMPLES / "chgnet.py")
    assert env.checkpoints == {
        "chgnet-0.3.0": "0.3.0",
        "chgnet-0.2.0": "0.2.0",
        "chgnet-r2scan": "r2scan",
        "chgnet:custom": None,
    }
    assert env.has_setup_from_path
    assert "mlp_out_bias" in env.source
    assert env.line_of("chgnet:custom") == env.line_of("chgnet-0.3.0") + 3


def test_sevennet_sample_lists_only_wheel_checkpoints():
    env = read_env_file(SAMPLES / "sevennet.py")
    assert env.declared_ids() == [
        "sevennet-0",
        "sevennet-0-22may2024",
        "sevennet-l3i5",
        "sevennet-mf-0",
        "sevennet:custom",
    ]
    assert env.verify_kwargs == {"sevennet-mf-0": {"modal": "PBE"}}
    assert env.has_setup_from_path


def test_production_samples():
    uma = read_env_file(SAMPLES / "uma.py")
    # A custom checkpoint may lack the omat head: no silent default for uma:custom.
    named = [cid for cid in uma.checkpoints if not cid.endswith(":custom")]
    assert uma.verify_kwargs == {cid: {"task": "omat"} for cid in named}
    assert uma.has_download
    mace = read_env_file(SAMPLES / "mace.py")
    assert {"setup", "setup_from_path", "download"} <= mace.functions
    assert mace.checkpoints["mace:custom"] is None
    assert "mace-mp-0-medium" in mace.checkpoints
    orb = read_env_file(SAMPLES / "orb.py")
    assert orb.has_download
    assert orb.verify_checks["orb-v3-direct-20-omat"] == {"forces": "direct", "stress": "direct"}
    assert read_env_file(SAMPLES / "tensornet.py").checkpoints


@pytest.mark.parametrize(
    ("name", "batches"),
    [
        ("chgnet", True),
        ("sevennet", True),
        ("mace", True),
        ("orb", True),
        ("uma", False),
        ("tensornet", False),
        ("emt", False),
    ],
)
def test_native_batch_hooks_ship_only_where_the_library_batches(name, batches):
    """The four families with a batched call ship ``evaluate_batch``; the rest loop."""
    env, problems = parse_env_file(SAMPLES / f"{name}.py")
    assert problems == []
    assert env.has_evaluate_batch is batches


# --- valid shapes the lint must accept ------------------------------------------------


def test_variant_with_clusters_and_verify_structure(tmp_path):
    path = write_env(
        tmp_path,
        "toy-della",
        """
        CHECKPOINTS: dict[str, str | None] = {
            "toy-1": "toy",
            "toy:custom": None,
        }
        VERIFY_KWARGS = {"toy-1": {"task": "omat", "cutoff": 5.0, "heads": ["a"]}}
        CLUSTERS = ["Della", "della", "tiger"]
        VERIFY_STRUCTURE = {
            "symbols": "Cu2",
            "positions": [[0, 0, 0], [1.8, 1.8, 0.0]],
            "cell": [[3.6, 0, 0], [0, 3.6, 0], [0, 0, 3.6]],
            "pbc": [True, True, False],
        }


        def setup_from_path(path, device="cuda", **kw):
            return setup("toy-1", device)
        """,
    )
    env = read_env_file(path)
    assert env.is_variant and env.clusters == ["della", "tiger"]
    assert env.verify_kwargs["toy-1"]["heads"] == ["a"]
    assert env.verify_structure["symbols"] == "Cu2"
    assert env.table_lines["CLUSTERS"] < env.table_lines["VERIFY_STRUCTURE"]
    assert env.line_of("toy:custom") == env.line_of("toy-1") + 1


def test_verify_checks_are_read_per_checkpoint(tmp_path):
    path = write_env(
        tmp_path,
        "toy-orb",
        """
        CHECKPOINTS = {"toy-direct": "d", "toy-capped": "c", "toy-plain": "p"}
        VERIFY_CHECKS = {
            "toy-direct": {"forces": "direct", "stress": "direct"},
            "toy-capped": {"energy": "non-smooth"},
        }
        """,
    )
    env = read_env_file(path)
    assert env.verify_checks == {
        "toy-direct": {"forces": "direct", "stress": "direct"},
        "toy-capped": {"energy": "non-smooth"},
    }
    assert "toy-plain" not in env.verify_checks


def test_verify_checks_mode_message_names_the_allowed_modes():
    (problem,) = corpus_problems("verify-checks-unknown-mode")
    assert "gradient, direct" in problem.fix
    (problem,) = corpus_problems("verify-checks-unknown-key")
    assert "forces, stress, energy" in problem.fix


def test_molecule_structure_without_cell(tmp_path):
    path = write_env(
        tmp_path,
        "toy",
        """
        CHECKPOINTS = {"toy-1": "toy"}
        VERIFY_STRUCTURE = {
            "symbols": ["O", "H", "H"],
            "positions": [[0, 0, 0.12], [0, 0.76, -0.47], [0, -0.76, -0.47]],
        }
        """,
    )
    structure = read_env_file(path).verify_structure
    assert structure["symbols"] == ["O", "H", "H"] and "cell" not in structure


@pytest.mark.parametrize(
    "signature",
    ['checkpoint, device="cuda"', "checkpoint, **kw", "checkpoint, *, device", "*args, **kw"],
)
def test_setup_signatures_that_can_take_checkpoint_and_device(tmp_path, signature):
    path = tmp_path / "toy.py"
    path.write_text(
        '# /// script\n# dependencies = ["ase"]\n# ///\n'
        'CHECKPOINTS = {"toy-1": "toy"}\n'
        f"def setup({signature}):\n    pass\n"
    )
    env = read_env_file(path)
    assert env.requires_python is None


def test_env_source_is_read_under_the_env_name(tmp_path):
    source = (SAMPLES / "emt.py").read_text()
    built = tmp_path / "envs" / "emt"
    built.mkdir(parents=True)
    (built / "env_source.py").write_text(source)
    env = read_env_file(built / "env_source.py", "emt")
    assert env.name == "emt"
    assert env.source_hash == source_hash(source)
    assert source_hash(source + "\n") != env.source_hash


def test_reading_tables_never_imports_the_model(tmp_path):
    path = write_env(
        tmp_path,
        "toy",
        """
        import this_package_does_not_exist  # only the worker imports this file

        CHECKPOINTS = {"toy-1": "toy"}
        raise SystemExit("an env file must never be executed by the client")
        """,
    )
    assert read_env_file(path).declared_ids() == ["toy-1"]


# --- ids shared between installed envs ------------------------------------------------


def conflict_fixture(tmp_path, name, clusters=None, ids=("shared-1",)):
    body = "CHECKPOINTS = {" + ", ".join(f'"{i}": "{i}"' for i in ids) + "}\n"
    if clusters is not None:
        body += f"CLUSTERS = {clusters!r}\n"
    return read_env_file(write_env(tmp_path, name, body))


def test_universal_against_universal_conflicts(tmp_path):
    installed = conflict_fixture(tmp_path, "first")
    new = conflict_fixture(tmp_path, "second", ids=("own-1", "shared-1"))
    (problem,) = id_conflicts(new, [installed])
    assert "'shared-1' is already declared by the installed env 'first'" in problem.message
    assert problem.line == new.line_of("shared-1")
    assert "CLUSTERS variant" in problem.fix
    assert str(problem).startswith(f"{new.path}:{problem.line}: ")


def test_variant_against_universal_is_allowed_both_ways(tmp_path):
    universal = conflict_fixture(tmp_path, "universal")
    variant = conflict_fixture(tmp_path, "variant", clusters=["della"])
    assert id_conflicts(variant, [universal]) == []
    assert id_conflicts(universal, [variant]) == []


def test_variants_on_overlapping_clusters_conflict(tmp_path):
    first = conflict_fixture(tmp_path, "first", clusters=["della", "Delta"])
    second = conflict_fixture(tmp_path, "second", clusters=["delta", "sophia"])
    (problem,) = id_conflicts(second, [first])
    assert "installed variant 'first' for cluster(s) delta" in problem.message
    assert "drop delta from the CLUSTERS" in problem.fix


def test_variants_on_disjoint_clusters_are_allowed(tmp_path):
    first = conflict_fixture(tmp_path, "first", clusters=["della"])
    second = conflict_fixture(tmp_path, "second", clusters=["sophia", "polaris"])
    assert id_conflicts(second, [first]) == []


def test_reinstalling_the_same_env_is_not_a_conflict(tmp_path):
    env = conflict_fixture(tmp_path, "same")
    assert id_conflicts(env, [env]) == []


def test_every_shared_id_is_reported(tmp_path):
    installed = conflict_fixture(tmp_path, "first", ids=("a-1", "b-1", "c-1"))
    new = conflict_fixture(tmp_path, "second", ids=("b-1", "c-1", "d-1"))
    assert [p.message.split("'")[1] for p in id_conflicts(new, [installed])] == ["b-1", "c-1"]


def test_a_script_block_nested_past_the_bound_is_a_lint_problem(tmp_path):
    # tomllib recurses: 100,000 nested arrays raise RecursionError, not a decode error.
    path = tmp_path / "deep.py"
    path.write_text(
        '"""Deep on purpose."""\n\n# /// script\n'
        f'# dependencies = ["ase"]\n# x = {"[" * 100_000}\n# ///\n\n'
        'CHECKPOINTS = {"deep-1": "x"}\n\n\ndef setup(checkpoint, device="cuda", **kw):\n'
        "    return None\n"
    )
    _, problems = parse_env_file(path)
    assert any("nested deeper than" in p.message for p in problems), problems


# --- the evaluate_batch hook's signature ------------------------------------------------


def _batch_hook_problems(tmp_path: Path, header: str) -> list[LintProblem]:
    path = write_env(
        tmp_path,
        "toy",
        f"""
        CHECKPOINTS = {{"toy-1": "toy"}}


        {header}
            return []
        """,
    )
    return parse_env_file(path)[1]


@pytest.mark.parametrize(
    "header",
    [
        "def evaluate_batch(calc, atoms_list, properties):",
        "def evaluate_batch(calc, atoms_list, properties, /):",
        "def evaluate_batch(calc, atoms_list, properties, chunk=16, *, strict=False):",
        "def evaluate_batch(calc, *rest):",
        "def evaluate_batch(*args, **kw):",
    ],
)
def test_batch_hook_signatures_the_worker_can_call(tmp_path, header):
    assert _batch_hook_problems(tmp_path, header) == []


@pytest.mark.parametrize(
    ("header", "says"),
    [
        ("def evaluate_batch(atoms_list):", "takes 1 positional argument(s) (atoms_list)"),
        ("def evaluate_batch():", "takes 0 positional argument(s) (nothing)"),
        (
            "def evaluate_batch(calc, atoms_list, properties, batch_size):",
            "requires 4 positional arguments (batch_size has no default)",
        ),
        (
            "def evaluate_batch(calc, atoms_list, *, properties):",
            "takes 2 positional argument(s) (calc, atoms_list)",
        ),
        (
            "def evaluate_batch(calc, atoms_list, properties, *, device):",
            "requires keyword-only argument(s) device",
        ),
        ("async def evaluate_batch(calc, atoms_list, properties):", "is async"),
    ],
)
def test_batch_hook_signatures_the_worker_cannot_call(tmp_path, header, says):
    problems = _batch_hook_problems(tmp_path, header)
    assert len(problems) == 1, problems
    (problem,) = problems
    assert says in problem.message
    assert problem.line == 11  # the def line, after the script block and the table
    assert "def evaluate_batch(calc, atoms_list, properties)" in problem.fix


def test_a_bad_batch_hook_fails_the_install_lint(tmp_path):
    path = write_env(
        tmp_path,
        "toy",
        """
        CHECKPOINTS = {"toy-1": "toy"}


        def evaluate_batch(calc, atoms_list):
            return []
        """,
    )
    with pytest.raises(EnvFileError) as caught:
        read_env_file(path)
    assert "evaluate_batch" in str(caught.value)


# --- CHECKPOINT_INFO ------------------------------------------------------------------


def test_an_unknown_checkpoint_info_field_is_a_warning_not_a_problem(tmp_path):
    path = write_env(
        tmp_path,
        "toy",
        """
        CHECKPOINTS = {"toy-1": "toy"}
        CHECKPOINT_INFO = {
            "toy-1": {
                "licence": "MIT",
                "licence_url": "https://example.org/licence",
            },
        }
        """,
    )
    env, problems = parse_env_file(path)
    assert problems == []
    (warning,) = env.warnings
    assert warning.line == 12  # the field's own line
    assert "unknown field 'licence_url'" in warning.message
    assert "licence, gated, source, citation, training_data, summary" in warning.fix
    # The known fields are kept; the unknown one is not passed on.
    assert env.checkpoint_info == {"toy-1": {"licence": "MIT"}}
    assert read_env_file(path).warnings == env.warnings  # never raised as an error


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("licence", '"Apache-2.0"'),
        ("licence", '"MIT OR Apache-2.0"'),
        ("licence", '"proprietary"'),
        ("licence", '"custom:https://github.com/gabor1/ASL"'),
        ("gated", "None"),
        ("gated", '"https://huggingface.co/facebook/UMA"'),
        ("citation", '"10.1038/s42256-023-00716-3"'),
        ("citation", '"arXiv:2401.00096"'),
        ("citation", '"arXiv:2504.06231v2"'),
    ],
)
def test_checkpoint_info_accepts_each_documented_form(tmp_path, field, value):
    body = (
        f'CHECKPOINTS = {{"toy-1": "toy"}}\nCHECKPOINT_INFO = {{"toy-1": {{"{field}": {value}}}}}'
    )
    env, problems = parse_env_file(write_env(tmp_path, "toy", body))
    assert problems == [] and env.warnings == []
    assert field in env.checkpoint_info["toy-1"]


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("licence", '"custom:not-a-url"', "not an SPDX id"),
        ("licence", "3", "it must be a non-empty string"),
        ("gated", "True", "must be None or the URL"),
        ("gated", '"huggingface.co/facebook/UMA"', "must be None or the URL"),
        ("citation", '"2401.00096"', "neither a DOI nor an arXiv id"),
        ("summary", '""', "it must be a non-empty string"),
        ("source", '["a", "b"]', "it must be a non-empty string"),
    ],
)
def test_checkpoint_info_refuses_a_wrong_value_with_a_fix(tmp_path, field, value, needle):
    body = (
        f'CHECKPOINTS = {{"toy-1": "toy"}}\nCHECKPOINT_INFO = {{"toy-1": {{"{field}": {value}}}}}'
    )
    _env, problems = parse_env_file(write_env(tmp_path, "toy", body))
    (problem,) = problems
    assert problem.message.startswith(f"CHECKPOINT_INFO['toy-1']['{field}'] ")
    assert needle in problem.message
    assert problem.fix.startswith(f'write "{field}": ')


def test_every_sample_describes_every_checkpoint_id():
    variants = [read_env_file(path) for path in sorted(AURORA.glob("*.py"))]
    assert variants, "the aurora_configs variants are checked too"
    for env in [*sample_envs(), *variants]:
        assert "CHECKPOINT_INFO" in env.table_lines, env.name
        assert set(env.checkpoint_info) == set(env.checkpoints), env.name
        assert env.warnings == [], env.name
        for checkpoint, info in env.checkpoint_info.items():
            if checkpoint.endswith(":custom"):
                # Only what is true of any user's weights: no licence, source or paper.
                assert set(info) <= {"summary"}, (env.name, checkpoint)
    uma = next(e for e in sample_envs() if e.name == "uma")
    assert uma.gated_url("uma-s-1p1") == "https://huggingface.co/facebook/UMA"
    # A variant wins on its clusters: it must say the same, or gating goes unchecked there.
    (uma_xpu,) = [e for e in variants if e.name == "uma-xpu"]
    assert uma_xpu.gated_url("uma-s-1p1") == uma.gated_url("uma-s-1p1")
    assert uma.gated_url("uma:custom") is None
