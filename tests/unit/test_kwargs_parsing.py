"""``--kwarg K=V`` parsing (:func:`rootstock.cli.kwargs.parse_kwargs`).

A value is standard JSON when it parses and a string otherwise; nesting is
bounded, so a hostile or mistyped value is a usage error, never a RecursionError.
"""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rootstock.cli.kwargs import parse_kwargs
from rootstock.errors import UsageError
from rootstock.install.parsing import MAX_KWARG_DEPTH

pytestmark = pytest.mark.timeout(60)


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def test_no_pairs_means_verify_kwargs():
    assert parse_kwargs(()) is None
    assert parse_kwargs([]) is None


def test_json_values_are_decoded():
    assert parse_kwargs(["scale=2", 'heads=["omat"]', "flag=true", 'name="foo"']) == {
        "scale": 2,
        "heads": ["omat"],
        "flag": True,
        "name": "foo",
    }


@pytest.mark.parametrize(
    "value", ["omat", "", "NaN", "Infinity", "-Infinity", "1e999", "[1, NaN]", "{bad", "ünï"]
)
def test_text_that_is_not_standard_json_stays_the_string_typed(value):
    # NaN and 1e999 used to become float nan/inf: not JSON anywhere else.
    assert parse_kwargs([f"x={value}"]) == {"x": value}


@pytest.mark.parametrize(
    "value",
    ["[" * 100_000, nested(100_000), nested(100)],
    ids=["100000-unclosed", "100000-deep", "100-deep"],
)
def test_deep_json_is_a_usage_error_naming_the_key_and_the_bound(value):
    # The stdlib parser recurses: 100,000 open brackets are a RecursionError, closed
    # or not, long before the text is found unterminated.
    with pytest.raises(UsageError) as caught:
        parse_kwargs([f"heads={value}"])
    assert "--kwarg heads" in caught.value.message
    assert str(MAX_KWARG_DEPTH) in caught.value.message


def test_shallow_unterminated_json_is_text():
    # Not JSON at all (it ends early), so it is the string typed, as before.
    assert parse_kwargs(["x=" + "[" * 100]) == {"x": "[" * 100}


def test_the_depth_bound_is_inclusive():
    assert parse_kwargs([f"x={nested(MAX_KWARG_DEPTH)}"]) is not None
    with pytest.raises(UsageError, match="nested deeper than"):
        parse_kwargs([f"x={nested(MAX_KWARG_DEPTH + 1)}"])
    with pytest.raises(UsageError, match="deeper than 3 levels"):
        parse_kwargs([f"x={nested(4)}"], max_depth=3)


@pytest.mark.parametrize("pair", ["x", "=1", "", "=", "task =omat", "a\tb=1", "a\x00=1"])
def test_malformed_pairs_are_usage_errors(pair):
    with pytest.raises(UsageError):
        parse_kwargs([pair])


def test_a_key_given_twice_is_a_usage_error():
    with pytest.raises(UsageError, match="given twice"):
        parse_kwargs(["scale=1", "scale=2"])


def test_a_value_may_hold_equals_signs_and_keys_need_not_be_identifiers():
    # setup(**kw) takes any string key; only whitespace and control characters are typos.
    assert parse_kwargs(["expr=a=b", "model-name=x"]) == {"expr": "a=b", "model-name": "x"}


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(max_size=40), max_size=4))
def test_any_pairs_give_a_dict_or_a_usage_error(pairs):
    try:
        result = parse_kwargs(pairs)
    except UsageError:
        return
    assert result is None or isinstance(result, dict)


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=1, max_value=3000), st.sampled_from(["[", '{"a":', '[{"b":']))
def test_any_nesting_gives_a_value_or_a_usage_error(depth, opener):
    with contextlib.suppress(UsageError):
        parse_kwargs([f"k={opener * depth}"])
