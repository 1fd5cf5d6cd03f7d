"""Credentials never reach a shareable record (the run itself receives the real values). A name is a credential's
when one of its words (split on `-`, `_`, `.`; any case) is `token`, `password`, `passwd` or `secret`, or two are
`api` `key` (or one `apikey`); whole words only: a plural (`--max_tokens_per_batch`) names a count, never a secret.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional


REDACTED = "REDACTED"  # no character a shell would quote: commands stay readable

_SECRET_WORDS = {"token", "password", "passwd", "secret", "apikey"}
# Values this short are not scrubbed from free text (a flag's "True", a "1"): scrubbing them would
# mangle the text, and no real credential is that short.
_MIN_SCRUBBED_LENGTH = 4


def is_secret_name(name: str) -> bool:
    """Whether a flag (`--hub_token`), a configuration key or an environment variable names a credential."""
    words = [w for w in re.split(r"[-_.]+", name.lower()) if w]
    return any(w in _SECRET_WORDS for w in words) or any(a == "api" and b == "key" for a, b in zip(words, words[1:]))


def redact_args(args: Sequence[str]) -> list[str]:
    """`args` with the value of every credential flag, `--flag value` or `--flag=value`, replaced by REDACTED. A
    credential flag followed by another flag (a boolean such as `--use_auth_token`) takes no value."""
    redacted: list[str] = []
    value_follows = False
    for arg in map(str, args):
        flag, eq, _ = arg.partition("=")
        secret = arg.startswith("--") and is_secret_name(flag)
        if value_follows and not arg.startswith("-"):
            arg = REDACTED
        elif secret and eq:
            arg = f"{flag}={REDACTED}"
        value_follows = secret and not eq
        redacted.append(arg)
    return redacted


# One word of a shell line: quoted and unquoted parts run together (`"--hub_token"=x`, `'hf'_abc`); a quote left
# open runs to the end (a line that shlex cannot split, stray quotes and all, still has its credentials found).
_SHELL_WORD = re.compile(r"""(?:"[^"]*(?:"|$)|'[^']*(?:'|$)|\\.|[^\s"'\\])+""")
_QUOTING = re.compile(r"""["'\\]""")
# A flag and its value anywhere, inside quotes too (`'--hub_token hf_abc` is one word to the shell, quote left open).
_FLAG_IN_TEXT = re.compile(r"""(--[\w.-]+)(=|\s+)("[^"]*(?:"|$)|'[^']*(?:'|$)|[^\s"'-][^\s"']*)""")


def redact_text(text: str) -> str:
    """Text holding a command line as typed (even one shlex cannot split) with each credential flag's value, quotes
    included, redacted: the word after the flag (unless it is a flag), or what follows its `=`; inside quotes too."""
    parts, end, value_follows = [], 0, False
    for word in _SHELL_WORD.finditer(text):
        bare = _QUOTING.sub("", word[0])
        flag, eq, _ = bare.partition("=")
        secret = bare.startswith("--") and is_secret_name(flag)
        shown = word[0]
        if value_follows and not bare.startswith("--"):
            shown = REDACTED
        elif secret and eq:
            shown = f"{word[0].partition('=')[0]}={REDACTED}"
        value_follows = secret and not eq
        parts += [text[end : word.start()], shown]
        end = word.end()
    text = "".join(parts) + text[end:]
    return _FLAG_IN_TEXT.sub(lambda m: f"{m[1]}{m[2]}{REDACTED}" if is_secret_name(m[1]) else m[0], text)


def without_secrets(arguments):
    """A shallow copy of a dataclass of arguments with every credential field set to None (itself if none is set)."""
    secret = [
        f.name for f in dataclasses.fields(arguments) if is_secret_name(f.name) and getattr(arguments, f.name, None)
    ]
    blank = copy.copy(arguments) if secret else arguments
    for name in secret:
        setattr(blank, name, None)
    return blank


def secret_values(
    args: Sequence[str] = (), env: Optional[Mapping[str, str]] = None, configs: Iterable[Any] = ()
) -> set[str]:
    """The credential values in an argument list, an environment and JSON configurations: what `scrub` removes."""
    args = [str(arg) for arg in args]  # what redact_args changes: a `--flag=value`'s value, a value after its flag
    values = {a.partition("=")[2] if a.startswith("--") else a for a, r in zip(args, redact_args(args)) if a != r}
    values.update(v for k, v in (env or {}).items() if is_secret_name(k))
    for config in configs:
        if isinstance(config, Mapping):
            for k, v in config.items():
                if is_secret_name(str(k)) and isinstance(v, str):
                    values.add(v)
                else:
                    values |= secret_values(configs=[v])
        elif isinstance(config, (list, tuple)):
            arguments = config if all(isinstance(v, str) for v in config) else ()  # a list of strings: arguments
            values |= secret_values(arguments, configs=config)
    return {v for v in values if len(v) >= _MIN_SCRUBBED_LENGTH and v.lower() not in ("true", "false", "none")}


def scrub(text, secrets: Iterable[str]):
    """`text` (str or bytes) with every occurrence of each of `secrets` replaced by REDACTED (longest first)."""
    for value in sorted(secrets, key=len, reverse=True):
        old, new = (value.encode(), REDACTED.encode()) if isinstance(text, bytes) else (value, REDACTED)
        text = text.replace(old, new)
    return text


def shareable(record: Any, args: Sequence[str] = (), env: Optional[Mapping[str, str]] = None) -> Any:
    """A JSON-able record made safe to share: credential keys' values and lists of strings (`redact_args`) redacted,
    every credential value in `args`, `env` (default: this process's) or the record scrubbed from its strings."""
    secrets = secret_values(args, os.environ if env is None else env, configs=[record])

    def walk(value):
        if isinstance(value, Mapping):
            return {
                k: REDACTED if is_secret_name(str(k)) and v not in (None, "") else walk(v) for k, v in value.items()
            }
        if isinstance(value, (list, tuple)):
            if value and all(isinstance(v, str) for v in value):
                value = redact_args(value)
            return [walk(v) for v in value]
        return scrub(value, secrets) if isinstance(value, str) else value

    return walk(record)
