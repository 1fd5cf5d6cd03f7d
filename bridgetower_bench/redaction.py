"""Credentials never reach a shareable record: argument lists, JSON configurations, environments and text.

A name is a credential's when one of its words (the name split on `-`, `_` and `.`, any case) is
`token`, `password`, `passwd` or `secret`, or two adjacent words are `api` `key` (or one is `apikey`):
`--token`, `--hub_token`, `--push_to_hub_token`, `--use_auth_token`, `HF_TOKEN`,
`HUGGING_FACE_HUB_TOKEN`, `WANDB_API_KEY`, `--db_password`, `--client_secret`. Whole words only, so
`--tokenizer_name`, `--max_tokens_per_batch` (a plural names a count or a list, never a credential),
`--max_seq_length` and `--pad_to_max_length` are left as they are.

The run itself always receives the real values; only what is written for others to read goes
through these functions.
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


def _secret_flag(arg: str) -> Optional[tuple[str, Optional[str]]]:
    """(flag, value or None) when `arg` is `--secret_flag` or `--secret_flag=value`; else None."""
    if not arg.startswith("--"):
        return None
    flag, eq, value = arg.partition("=")
    if not is_secret_name(flag):
        return None
    return flag, (value if eq else None)


def redact_args(args: Sequence[str]) -> list[str]:
    """`args` with the value of every credential flag replaced by REDACTED, in `--flag value` and
    `--flag=value` forms. A credential flag followed by another flag (a boolean such as
    `--use_auth_token`) takes no value, and the next flag is kept."""
    redacted: list[str] = []
    value_follows = False
    for arg in map(str, args):
        if value_follows and not arg.startswith("-"):
            redacted.append(REDACTED)
            value_follows = False
            continue
        value_follows = False
        secret = _secret_flag(arg)
        if secret is not None and secret[1] is not None:
            redacted.append(f"{secret[0]}={REDACTED}")
            continue
        value_follows = secret is not None
        redacted.append(arg)
    return redacted


# A flag and its value as a shell line writes them: `--flag value`, `--flag=value`, the value quoted or not; a
# quote left open runs to the end (a line that shlex cannot split still has its credentials found).
_FLAG_IN_TEXT = re.compile(r"""(--[\w.-]+)(=|\s+)("[^"]*(?:"|$)|'[^']*(?:'|$)|[^\s"'-]\S*)""")


def redact_text(text: str) -> str:
    """A command line as the user typed it (one string, perhaps one shlex cannot split: an unclosed quote)
    with the value of every credential flag replaced by REDACTED, quotes included."""
    return _FLAG_IN_TEXT.sub(
        lambda m: f"{m[1]}{m[2]}{REDACTED}" if is_secret_name(m[1]) else m[0],
        text,
    )


def without_secrets(arguments):
    """A shallow copy of a dataclass of arguments (e.g. TrainingArguments) with every credential field
    set to None, or `arguments` itself when none is set."""
    secret = [
        f.name for f in dataclasses.fields(arguments) if is_secret_name(f.name) and getattr(arguments, f.name, None)
    ]
    if not secret:
        return arguments
    blank = copy.copy(arguments)
    for name in secret:
        setattr(blank, name, None)
    return blank


def secret_values(
    args: Sequence[str] = (), env: Optional[Mapping[str, str]] = None, configs: Iterable[Any] = ()
) -> set[str]:
    """The credential values in an argument list, an environment and JSON configurations (credential
    keys, and argument lists inside them): what `scrub` removes from free text (a run's output)."""
    values: set[str] = set()
    value_follows = False
    for arg in args:
        arg = str(arg)
        if value_follows and not arg.startswith("-"):
            values.add(arg)
        value_follows = False
        secret = _secret_flag(arg)
        if secret is not None:
            if secret[1] is not None:
                values.add(secret[1])
            else:
                value_follows = True
    values.update(v for k, v in (env or {}).items() if is_secret_name(k))

    def walk(config):
        if isinstance(config, Mapping):
            for k, v in config.items():
                if is_secret_name(str(k)) and isinstance(v, str):
                    values.add(v)
                else:
                    walk(v)
        elif isinstance(config, (list, tuple)):
            if config and all(isinstance(v, str) for v in config):  # an argument list
                values.update(secret_values(config))
            for v in config:
                walk(v)

    for config in configs:
        walk(config)
    return {v for v in values if len(v) >= _MIN_SCRUBBED_LENGTH and v.lower() not in ("true", "false", "none")}


def scrub(text, secrets: Iterable[str]):
    """`text` (str or bytes) with every occurrence of each of `secrets` replaced by REDACTED (longest first)."""
    for value in sorted(secrets, key=len, reverse=True):
        if isinstance(text, bytes):
            text = text.replace(value.encode(), REDACTED.encode())
        else:
            text = text.replace(value, REDACTED)
    return text


def shareable(record: Any, args: Sequence[str] = (), env: Optional[Mapping[str, str]] = None) -> Any:
    """A JSON-able record (dicts, lists, strings, numbers) made safe to share, for any tool that writes
    one: the value of every credential key is redacted, every list of strings is treated as an
    argument list (`redact_args`), and every credential value found in `args`, in `env` (default: this
    process's environment) or in the record itself is scrubbed from its strings."""
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
