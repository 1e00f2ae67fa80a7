"""ddpkit.render.quoting: every escaping rule round-trips hostile text, through its
own inverse and through the real consumer (bash, the kubelet's expansion,
compose's interpolation)."""

from __future__ import annotations

import subprocess

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddpkit.render import quoting
from tests.expansion import InterpolationError, compose_interpolate, kubelet_expand

FRAGMENTS = ["'", '"', "\\", "$(id)", "`id`", "$$", "${HOME}", "$HOME", "$", "\n", "\r", "\t", " ", "#", "!",
             ";", "&", "|", "*", "~", "(", ")", "{", "}", "-", "--x", "=", "é", "\u2028", "'\\''"]
# Any text a shell, a YAML file and an environment can carry (no NUL, no
# lone surrogate), biased towards what breaks quoting.
hostile = st.one_of(
    st.lists(st.sampled_from(FRAGMENTS), max_size=12).map("".join),
    st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=40),
    st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=3).filter(
        lambda t: "\x00" not in t and not any(0xD800 <= ord(c) <= 0xDFFF for c in t))), max_size=8).map("".join),
)
SETTINGS = settings(max_examples=200, deadline=None)
BASH_SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def bash_words(command_line: str, env: dict[str, str] | None = None) -> list[str]:
    """Run `printf '%s\\0' <command_line>` in a real bash; the words it got."""
    result = subprocess.run(["bash", "--norc", "--noprofile", "-c", f"printf '%s\\0' {command_line}"],
                            capture_output=True, check=True, env=env or {})
    return result.stdout.decode("utf-8").split("\0")[:-1]


# ---- shell words ----


@SETTINGS
@given(hostile)
def test_shell_word_round_trips(text: str) -> None:
    assert quoting.shell_words_of(quoting.shell_word(text)) == [text]
    assert quoting.shell_words_of(quoting.single_quoted(text)) == [text]


@SETTINGS
@given(hostile, hostile)
def test_first_shell_word_reads_one_word_and_stops(text: str, rest: str) -> None:
    line = quoting.shell_word(text) + " " + quoting.shell_word(rest) + "\nunparsed 'open quote"
    assert quoting.first_shell_word(line) == text


@BASH_SETTINGS
@given(st.lists(hostile, min_size=1, max_size=4))
def test_bash_reads_shell_words_back_byte_for_byte(words: list[str]) -> None:
    line = " ".join(quoting.shell_word(w) for w in words[:2]) + " " + " ".join(
        quoting.single_quoted(w) for w in words[2:])
    assert bash_words(line) == words


def test_single_quoted_quotes_even_plain_words() -> None:
    assert quoting.shell_word("a,b") == "a,b"
    assert quoting.single_quoted("a,b") == "'a,b'"
    assert quoting.single_quoted("it's") == "'it'\\''s'"


@BASH_SETTINGS
@given(hostile)
def test_shell_var_expands_on_the_node_as_one_word(value: str) -> None:
    assert bash_words(quoting.shell_var("V"), env={"V": value}) == [value]


# ---- bash -c nesting ----


@SETTINGS
@given(hostile, st.lists(hostile, max_size=3))
def test_bash_c_round_trips_through_its_inverse(script: str, args: list[str]) -> None:
    assert quoting.parse_bash_c(quoting.bash_c(script, *args)) == (script, args)
    line = quoting.bash_c(script, *args, bash="bash --norc")
    assert quoting.parse_bash_c(line, bash="bash --norc") == (script, args)


@BASH_SETTINGS
@given(hostile, hostile)
def test_bash_c_nested_twice_runs_with_the_arguments_intact(first: str, second: str) -> None:
    """The SSH payload shape: a `bash -c` line inside another one's script."""
    inner = quoting.bash_c('printf "%s\\0" "$0" "$@"', first, second)
    outer = quoting.bash_c(inner, "outer-name")
    result = subprocess.run(["bash", "--norc", "-c", outer], capture_output=True, check=True, env={})
    assert result.stdout.decode("utf-8").split("\0")[:-1] == [first, second]


def test_parse_bash_c_refuses_other_lines() -> None:
    with pytest.raises(ValueError, match="not a `bash -c` line"):
        quoting.parse_bash_c("sh -c 'true'")
    with pytest.raises(ValueError):
        quoting.parse_bash_c("bash -c")


# ---- kubelet $(VAR) and compose $VAR ----


@SETTINGS
@given(hostile)
def test_kubelet_literal_round_trips(text: str) -> None:
    escaped = quoting.kubelet_literal(text)
    assert quoting.kubelet_unliteral(escaped) == text
    # The kubelet itself (a port of its expansion code) leaves it literal,
    # even when every variable it names is defined.
    assert kubelet_expand(escaped, {"id": "EXPANDED", "HOME": "EXPANDED"}) == text


def test_kubelet_would_expand_unescaped_text() -> None:
    """The escape is needed: without it the kubelet runs the user's $(id)."""
    assert kubelet_expand("a $(id) b", {"id": "EXPANDED"}) == "a EXPANDED b"
    assert kubelet_expand(quoting.kubelet_literal("a $(id) b"), {"id": "EXPANDED"}) == "a $(id) b"


@SETTINGS
@given(hostile)
def test_compose_literal_round_trips(text: str) -> None:
    escaped = quoting.compose_literal(text)
    assert quoting.compose_unliteral(escaped) == text
    assert compose_interpolate(escaped, {"HOME": "EXPANDED"}) == text


def test_compose_would_interpolate_unescaped_text() -> None:
    assert compose_interpolate("${HOME}", {"HOME": "EXPANDED"}) == "EXPANDED"
    with pytest.raises(InterpolationError):
        compose_interpolate("$(id)", {})
