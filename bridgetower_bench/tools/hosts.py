"""Hosts, ports and endpoints that reach another machine: one grammar, by allowlist, for every surface that reads
one (hostfiles, `--nodes`, `--rdzv_endpoint`, `--master_addr`, `--master_port`, `--rdzv-port`, the sweep,
cluster_check). optimum-habana's DistributedRunner and DeepSpeed's pdsh line put hosts into bash lines unquoted,
so a value that passes is one shell word with no character a shell reads as code, however it is quoted later.

- host: a DNS name (RFC 1123 labels of letters, digits and inner `-`, dot-separated, at most 253 characters, the
  last label not all digits, an optional trailing dot), an IPv4 address, or an IPv6 address (brackets allowed)
  whose zone id, if any, is an interface name (1 to 15 of letters, digits, `_`, `.`, `-`). The kit passes it on
  bracket-free. `user@` (a portable POSIX user name) only where the kit reaches the node with ssh itself.
- port: 1 to 65535 in the digits 0-9, without sign, space or leading zero.
- endpoint (torch's rendezvous): HOST or HOST:PORT, an IPv6 address in brackets; no zone id (torch refuses `%`).

Anything else raises UserInputError: one line naming where the value was read and a short escaped excerpt of it.
Names are not resolved (a look-up of an unreachable name can take seconds); two spellings of one node (case, a
trailing dot, an address's forms) are one node.
"""

from __future__ import annotations

import ipaddress
import os
import re
import string

from bridgetower_bench.regular_files import read_regular_file
from bridgetower_bench.user_errors import UserInputError


LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")  # one label of a DNS name (RFC 1123)
USER = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}")  # a portable POSIX user name
ZONE = re.compile(r"[A-Za-z0-9_.-]{1,15}")  # an interface name (Linux: at most 15 characters)
PORT = re.compile(r"[1-9][0-9]{0,4}")
HOST_CHARACTERS = frozenset(string.ascii_letters + string.digits + "-._:%[]")  # names, addresses, zone ids
HOSTFILE_LINE = re.compile(r"(\S+)[ \t]+slots=([0-9]+)", re.ASCII)  # `HOST slots=N`, as DeepSpeed reads it
HOSTFILE_BYTES = 1 << 20  # a hostfile's bound: thousands of nodes fit in far less
HOSTFILE_LINE_BYTES = 512  # a line's: the longest host and its slots fit
EXCERPT = 60  # the most characters of a refused value a refusal quotes


def excerpt(value) -> str:
    """`value` as a refusal quotes it: escaped as repr() escapes it, at most EXCERPT characters of it."""
    text = str(value)
    shown = text[:EXCERPT]
    while len(repr(shown)) > EXCERPT + 2:  # (escapes lengthen it)
        shown = shown[:-1]
    return repr(shown) if shown == text else f"{shown!r}... ({len(text)} characters)"


def host(text: str, where: str, *, user: bool = False, zone: bool = True) -> str:
    """`text` once it is a host (`user@` too where `user`; a zone id unless not `zone`), in the bracket-free form
    the kit passes on; else UserInputError naming `where`."""
    problem = host_problem(text, user, zone)
    if problem:
        raise UserInputError(f"{where}: {excerpt(text)} {problem}")
    login, at, name = text.rpartition("@")
    return login + at + unbracketed(name)


def host_problem(text: str, user: bool = False, zone: bool = True) -> str:
    """Why `text` is not a host of the grammar, or ''."""
    if not text:
        return "is empty: give a host name or an IP address"
    if text.startswith("\ufeff"):
        return "starts with a byte-order mark: save the file as UTF-8 without one"
    if text.startswith("-"):
        return "starts with '-', which ssh and pdsh would read as an option: give a host name or an IP address"
    login, at, name = text.rpartition("@")
    if at and not user:
        return "has 'user@', which only a node the kit reaches by ssh takes (set the user in ~/.ssh/config)"
    if at and not USER.fullmatch(login):
        return "has a user part that is not a user name (letters, digits, '_', '.', '-')"
    odd = next((c for c in name if c not in HOST_CHARACTERS), None)
    if odd is not None:
        return f"has {odd!r}, which no host name or IP address has"
    ip = address(name)
    if ip is None:
        return (
            "" if is_dns_name(name) else "is not a host name (letters, digits, inner '-', dot-separated) or IP address"
        )
    scope = getattr(ip, "scope_id", None)
    if scope is not None and not zone:
        return "has a zone id ('%...'), which torch's rendezvous does not take: give the address without it"
    if scope is not None and not ZONE.fullmatch(scope):
        return "has a zone id that is not an interface name (1 to 15 of letters, digits, '_', '.', '-')"
    return ""


def address(text: str):
    """An IPv4 or IPv6 address (an IPv6 one may be in brackets), or None."""
    bracketed = text.startswith("[") and text.endswith("]")
    try:
        ip = ipaddress.ip_address(text[1:-1] if bracketed else text)
    except ValueError:
        return None
    return None if bracketed and ip.version != 6 else ip


def unbracketed(name: str) -> str:
    return name[1:-1] if name.startswith("[") else name


def is_dns_name(text: str) -> bool:
    name = text[:-1] if text.endswith(".") else text
    labels = name.split(".")
    return 0 < len(name) <= 253 and all(LABEL.fullmatch(label) for label in labels) and not labels[-1].isdigit()


def machine(text: str) -> str:
    """A checked host without its user, bracket-free: what a rendezvous address or --master_addr takes."""
    return unbracketed(text.rpartition("@")[2])


def endpoint_text(name: str, number: int | None = None) -> str:
    """`HOST[:PORT]` as torch reads it: an IPv6 address in brackets."""
    shown = f"[{name}]" if ":" in name else name
    return shown if number is None else f"{shown}:{number}"


def rendezvous_endpoint(node: str, number: int, where: str) -> str:
    """The c10d endpoint a checked node keeps at the port: torch takes its address without a zone id."""
    return endpoint_text(host(machine(node), where, zone=False), number)


def same_node_key(text: str) -> str:
    """What two spellings of one node share: the name without case or trailing dot; an address's canonical form."""
    name = machine(text)
    ip = address(name)
    return str(ip) if ip is not None else name.rstrip(".").lower()


def port(value, where: str) -> int:
    """A TCP port, 1 to 65535 in the digits 0-9 (an int is taken as its digits); else UserInputError naming `where`."""
    text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(text, str) or not PORT.fullmatch(text) or int(text) > 65535:
        raise UserInputError(f"{where}: {excerpt(value)} is not a port (1 to 65535)")
    return int(text)


def endpoint(text: str, where: str) -> tuple[str, int | None]:
    """A rendezvous endpoint, `HOST[:PORT]` with an IPv6 address in brackets, as (bracket-free host, port or None)."""
    if text.startswith("["):
        inside, close, rest = text[1:].partition("]")
        if close and (not rest or rest.startswith(":")):
            return host(f"[{inside}]", where, zone=False), port(rest[1:], where) if rest else None
    elif text.count(":") <= 1:
        name, colon, number = text.rpartition(":")
        return (host(name, where, zone=False), port(number, where)) if colon else (host(text, where, zone=False), None)
    raise UserInputError(f"{where}: {excerpt(text)} is not HOST[:PORT] (an IPv6 address in brackets: [ADDRESS]:PORT)")


def hostfile_flag(path: str) -> str:
    """`--hostfile PATH` as a refusal names it: the path as it is when printable and short, else an excerpt (a line
    break in it would break the refusal's one line)."""
    return f"--hostfile {path if path.isprintable() and len(path) <= 200 else excerpt(path)}"


def hostfile_nodes(path: str, gaudi: bool = True) -> dict[str, int]:
    """The nodes of a DeepSpeed hostfile (bracket-free) and their devices, in its order (the first node runs rank 0);
    bad input raises UserInputError naming the file and the line. `gaudi`: DeepSpeed's launcher reads it (a node
    has at most 8 HPUs; no `user@`: the first host is the master address); else the kit's ssh reaches the nodes."""
    named = hostfile_flag(path)
    try:
        size = os.stat(path).st_size
        data = read_regular_file(path, limit=HOSTFILE_BYTES) if size <= HOSTFILE_BYTES else b""
    except OSError as error:
        raise UserInputError(f"{named}: {error.strerror or error}") from None
    if max(size, len(data)) > HOSTFILE_BYTES:
        raise UserInputError(f"{named}: larger than a hostfile's {HOSTFILE_BYTES >> 20} MiB: not read")
    nodes: dict[str, int] = {}
    seen: dict[str, int] = {}  # same_node_key(host) -> its line
    for number, raw in enumerate(data.split(b"\n"), 1):
        where = f"{named}, line {number}"
        if len(raw) > HOSTFILE_LINE_BYTES:
            raise UserInputError(f"{where}: longer than {HOSTFILE_LINE_BYTES} bytes (`HOST slots=N` is far shorter)")
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
            raise UserInputError(f"{where}: {excerpt(line)} is not `HOST slots=N`")
        name, slots = host(entry[1], where, user=not gaudi), int(entry[2])
        key = same_node_key(name)
        if key in seen:
            raise UserInputError(f"{where}: {name} is the node of line {seen[key]} again")
        if gaudi and not 1 <= slots <= 8:
            raise UserInputError(f"{where}: slots={slots}: a Gaudi node has 1 to 8 HPUs")
        seen[key], nodes[name] = number, slots
    if not nodes:
        raise UserInputError(f"{named}: no `HOST slots=N` line")
    return nodes
