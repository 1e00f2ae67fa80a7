"""Every escaping rule ddpkit applies to text it writes for another program.

One function per context, each with its inverse (the tests round-trip
hostile text through both; docs/CONTRACT.md has the table):

- a POSIX shell word:                   shell_word / shell_words_of
- a word that is always single-quoted:  single_quoted / shell_words_of
- a script run by `bash -c`:            bash_c / parse_bash_c
- a node-side variable in shell:        shell_var (expands on the node)
- a value the kubelet expands $(VAR) in: kubelet_literal / kubelet_unliteral
- a value docker compose interpolates:  compose_literal / compose_unliteral
- an argument of an #SBATCH line:       sbatch_word / sbatch_words_of

YAML scalars are not here: they are JSON (render.yaml_scalar), which needs
no inverse but a YAML parser.
"""

from __future__ import annotations

import shlex


def shell_word(value: object) -> str:
    """One word for a POSIX shell, quoted only when it must be."""
    return shlex.quote(str(value))


def single_quoted(value: object) -> str:
    """One word, single-quoted even when plain (shellcheck reads a bare
    `a,b` inside an array as a mistaken separator)."""
    return "'" + str(value).replace("'", "'\\''") + "'"


def shell_words_of(text: str) -> list[str]:
    """The words a POSIX shell reads from `text` (no expansion): the inverse
    of shell_word and single_quoted."""
    return shlex.split(text, posix=True)


def first_shell_word(text: str) -> str | None:
    """The first word of `text` as a POSIX shell reads it; the rest (other
    lines, other commands) is not parsed. A word may span lines."""
    lexer = shlex.shlex(text, posix=True)
    lexer.whitespace_split = True
    return next(iter(lexer), None)


def shell_var(name: str) -> str:
    """A reference to a variable that the shell running the text expands,
    double-quoted so that its value stays one word."""
    return f'"${{{name}}}"'


def bash_c(script: str, *args: str, bash: str = "bash") -> str:
    """`bash -c SCRIPT ARG0 ARGS...` as one shell command line: the script
    and every argument are single words however many quotes they hold."""
    return " ".join([bash, "-c", shell_word(script), *(shell_word(a) for a in args)])


def parse_bash_c(line: str, *, bash: str = "bash") -> tuple[str, list[str]]:
    """(script, args) from a line bash_c wrote: its inverse."""
    words = shell_words_of(line)
    head = [*shell_words_of(bash), "-c"]
    if words[: len(head)] != head or len(words) <= len(head):
        raise ValueError(f"not a `{bash} -c` line: {line[:80]!r}")
    return words[len(head)], words[len(head) + 1 :]


def kubelet_literal(value: str) -> str:
    """Text the kubelet passes through unchanged: it expands `$(VAR)` in a
    container's command, args and env values, and turns `$$` into `$`."""
    return value.replace("$", "$$")


def kubelet_unliteral(value: str) -> str:
    """The inverse of kubelet_literal (for text with no `$(VAR)` in it)."""
    return value.replace("$$", "$")


def compose_literal(value: str) -> str:
    """Text docker compose passes through unchanged: it interpolates `$VAR`
    and `${VAR}` everywhere in the file, and turns `$$` into `$`."""
    return value.replace("$", "$$")


def compose_unliteral(value: str) -> str:
    """The inverse of compose_literal."""
    return value.replace("$$", "$")


# sbatch reads #SBATCH lines with its own parser (src/sbatch/opt.c,
# _get_argument), not a shell's: whitespace separates arguments, ' and "
# group, a backslash takes the next character literally (inside quotes too),
# and an unquoted # starts a comment.
_C_SPACE = frozenset(" \t\n\r\v\f")  # C's isspace() in sbatch's (C) locale, not str.isspace
_SBATCH_SPECIAL = _C_SPACE | frozenset("'\"\\#")


def sbatch_word(value: str) -> str:
    """One argument of an `#SBATCH` line, as sbatch's directive parser reads
    it back. Newlines cannot be carried (a directive is one line)."""
    if "\n" in value or "\r" in value or "\x00" in value:
        raise ValueError(f"{value!r}: an #SBATCH argument cannot hold a newline or NUL")
    if value and not any(c in _SBATCH_SPECIAL for c in value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def sbatch_words_of(text: str) -> list[str]:
    """The arguments sbatch reads from the rest of an `#SBATCH` line: the
    inverse of sbatch_word (a port of sbatch's _get_argument)."""
    words: list[str] = []
    i, n = 0, len(text)
    while True:
        while i < n and text[i] in _C_SPACE:
            i += 1
        if i >= n or text[i] == "#":
            return words
        word: list[str] = []
        quote = ""
        while i < n and (quote or text[i] not in _C_SPACE):
            c = text[i]
            if c == "\\":
                word.append(text[i + 1 : i + 2])
                i += 2
                continue
            if quote:
                if c == quote:
                    quote = ""
                else:
                    word.append(c)
            elif c in "'\"":
                quote = c
            elif c == "#":
                i = n  # the rest of the line is a comment
                break
            else:
                word.append(c)
            i += 1
        words.append("".join(word))
