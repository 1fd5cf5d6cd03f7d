"""Hosts and ports that reach another machine: parsed here once, for the launchers and the sweep.

A host ends up in a shell line on every node (pdsh's, ssh's, a printed command a user pastes), so it must be
a host and nothing else: a DNS name (RFC 1123 labels: letters, digits and inner dashes, the last label not all
digits) or an IPv4 / IPv6 address, optionally preceded by `user@` (a POSIX user name). Refused in one line
(UserInputError, naming where it was read): anything else, which covers shell metacharacters and spaces, a
leading dash (ssh and pdsh would read an option), a byte-order mark, a NUL or a non-UTF-8 byte, and a node given
twice (names compared without case and trailing dot, addresses in their canonical form; names are not resolved,
as a DNS look-up of an unreachable name can take seconds each). Ports are 1 to 65535. The callers still quote
whatever they put into a shell line (`shlex.quote`): a second guard.
"""

from __future__ import annotations

import ipaddress
import re

from bridgetower_bench.regular_files import read_regular_file
from bridgetower_bench.user_errors import UserInputError


HOSTFILE_LINE = re.compile(r"(\S+)\s+slots=(\d+)")  # a hostfile line, as both DeepSpeed and optimum-habana read it
LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")  # one label of a DNS name (RFC 1123)
USER = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}")  # a portable POSIX user name


def host(text: str, where: str) -> str:
    """`text` as it was given, once it is `[user@]name-or-address`; else UserInputError naming `where`."""
    problem = host_problem(text)
    if problem:
        raise UserInputError(f"{where}: {text!r} {problem}")
    return text


def host_problem(text: str) -> str:
    """Why `text` is not `[user@]host`, or ''."""
    if not text:
        return "is empty: give a host name or an IP address"
    if text.startswith("\ufeff"):
        return "starts with a byte-order mark: save the file as UTF-8 without one"
    if text.startswith("-"):
        return "starts with '-', which ssh and pdsh would read as an option: give a host name or an IP address"
    user, at, name = text.rpartition("@")
    if at and not USER.fullmatch(user):
        return "has a user part that is not a user name (letters, digits, '_', '.', '-')"
    if address(name) is not None or is_dns_name(name):
        return ""
    odd = next((c for c in name if not (c.isascii() and (c.isalnum() or c in ".-:"))), None)
    if odd is not None:
        return f"has {odd!r}, which no host name or IP address has"
    return "is not a host name (letters, digits, inner '-', dot-separated) or an IP address"


def address(text: str):
    """An IPv4 or IPv6 address (brackets allowed around IPv6), or None."""
    try:
        return ipaddress.ip_address(text[1:-1] if text.startswith("[") and text.endswith("]") else text)
    except ValueError:
        return None


def is_dns_name(text: str) -> bool:
    name = text[:-1] if text.endswith(".") else text
    labels = name.split(".")
    return 0 < len(name) <= 253 and all(LABEL.fullmatch(label) for label in labels) and not labels[-1].isdigit()


def machine(text: str) -> str:
    """The host without its user, as a rendezvous address takes it (an IPv6 address in brackets)."""
    name = text.rpartition("@")[2]
    ip = address(name)
    return name if ip is None else (f"[{ip}]" if ip.version == 6 else str(ip))


def same_node_key(text: str) -> str:
    """What two spellings of one node share: the name without case or trailing dot; an address's canonical form."""
    name = text.rpartition("@")[2]
    ip = address(name)
    return str(ip) if ip is not None else name.rstrip(".").lower()


def port(text, where: str) -> int:
    """A TCP port, 1 to 65535; else UserInputError naming `where`."""
    try:
        number = int(text)
    except (TypeError, ValueError):
        number = None
    if number is None or not 1 <= number <= 65535:
        raise UserInputError(f"{where}: {text!r} is not a port (1 to 65535)")
    return number


def endpoint(text: str, where: str) -> tuple[str, int | None]:
    """`HOST[:PORT]` (an IPv6 address in brackets when a port follows) as (host, port or None)."""
    if text.startswith("[") and "]" in text:
        name, _, rest = text[1:].partition("]")
        if rest and not rest.startswith(":"):
            raise UserInputError(f"{where}: {text!r} is not HOST[:PORT]")
        return host(name, where), port(rest[1:], where) if rest else None
    name, colon, number = text.rpartition(":") if text.count(":") == 1 else ("", "", "")
    if not colon:
        return host(text, where), None
    return host(name, where), port(number, where)


def hostfile_nodes(path: str, gaudi: bool = True) -> dict[str, int]:
    """The nodes of a DeepSpeed hostfile and their devices, in its order (the first node runs rank 0); bad input
    raises UserInputError naming the file and the line. `gaudi`: a node has at most 8 devices (HPUs)."""
    try:
        data = read_regular_file(path)
    except OSError as error:
        raise UserInputError(f"--hostfile {path}: {error.strerror or error}") from None
    nodes, seen = {}, {}
    for number, raw in enumerate(data.split(b"\n"), 1):
        where = f"--hostfile {path}, line {number}"
        if b"\0" in raw:
            raise UserInputError(f"{where}: a NUL byte (a hostfile is text)")
        try:
            line = raw.decode().strip()
        except UnicodeDecodeError:
            raise UserInputError(f"{where}: not UTF-8 text") from None
        if not line:
            continue
        entry = HOSTFILE_LINE.fullmatch(line)
        if entry is None:  # optimum-habana's runner reads every other line so (no comments)
            raise UserInputError(f"{where}: {line!r} is not `HOST slots=N`")
        name, slots = host(entry[1], where), int(entry[2])
        key = same_node_key(name)
        if key in seen:
            raise UserInputError(f"{where}: {name} is the node of line {seen[key]} again")
        if gaudi and not 1 <= slots <= 8:
            raise UserInputError(f"{where}: slots={slots}: a Gaudi node has 1 to 8 HPUs")
        seen[key], nodes[name] = number, slots
    if not nodes:
        raise UserInputError(f"--hostfile {path}: no `HOST slots=N` line")
    return nodes
