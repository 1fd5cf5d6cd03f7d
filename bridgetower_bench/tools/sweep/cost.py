"""What a configuration costs: the user's prices per device-hour turned into USD per 1M training samples.

No price is built in: every figure comes from `--price DEVICE=USD_PER_HOUR` (repeatable) or
`--prices FILE` (a JSON object `{"H100": 2.5}` or a CSV file with the columns `device,usd_per_hour`),
on the sweep (`tools/bench.py`) and on `tools/compare.py`. Without a price no cost column exists.

Which rows a price applies to (case-insensitive):
- a row of this machine (or of a compared run) matches a DEVICE that equals its device type (`cpu`, `cuda`,
  `hpu`) or that is part of its device name (`H100` in "NVIDIA H100 80GB HBM3", `EPYC` in "CPU AMD EPYC");
- a published row matches by name only: `Gaudi2`, `H100`, `A100 80GB` (or `A100`), and `Gaudi3` (upstream's CI
  baseline); `cuda` prices the GPUs of this machine, never the post's;
- when several DEVICEs match one row, a name beats the type and the longer name the shorter; two names of the
  same length matching one device are refused, as is a DEVICE that matches no row and no published device.

Arithmetic, for a row measured at S samples/s over D devices (S: the whole run, all devices) at P USD per
device-hour:

    USD per 1M training samples   = P x D / (S x 3600) x 1e6
    USD of the published run      = P x D x published.SAMPLES / (S x 3600)

where the published run is 5 epochs of the `matching` train split at that steady-state speed (no warm-up,
start-up or evaluation time).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn, Optional

from bridgetower_bench import published
from bridgetower_bench.redaction import redact_text
from bridgetower_bench.regular_files import read_regular_file
from bridgetower_bench.user_errors import UserInputError


# The published devices (published.THROUGHPUT, CI_BASELINES) and the names their prices are given under.
PUBLISHED_PRICE_NAMES = {
    "Gaudi2 HPU": "Gaudi2",
    "H100 GPU": "H100",
    "A100 80GB GPU": "A100 80GB",
    "Gaudi3 HPU": "Gaudi3",
}

COST_COLUMNS = ("price_device", "usd_per_device_hour", "usd_per_1m_samples", "usd_published_experiment")


@dataclass
class Price:
    device: str  # as the user wrote it
    usd_per_hour: float
    given: str  # where: "--price H100=2.5" or "--prices prices.csv line 3"

    @property
    def key(self) -> str:
        return self.device.casefold()


@dataclass
class Prices:
    """The user's prices per device-hour, and which rows they apply to."""

    entries: list[Price] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.entries)

    def for_device(self, device_type: Optional[str], device_name: Optional[str]) -> Optional[Price]:
        """The price of a row of this machine: its type, or a part of its name (the most specific one)."""
        return self._most_specific(device_type, device_name or "")

    def for_published(self, published_device: str) -> Optional[Price]:
        """The price of a published row ("H100 GPU"), matched by its short name only."""
        return self._most_specific(None, PUBLISHED_PRICE_NAMES.get(published_device, published_device))

    def _matches(self, device_type: Optional[str], device_name: str) -> list[tuple[int, Price]]:
        name, kind = device_name.casefold(), (device_type or "").casefold()
        found = []
        for price in self.entries:
            if price.key in name:
                found.append((len(price.key), price))  # names rank by length, above any type
            elif kind and price.key == kind:
                found.append((0, price))
        return found

    def _most_specific(self, device_type: Optional[str], device_name: str) -> Optional[Price]:
        found = sorted(self._matches(device_type, device_name), key=lambda m: -m[0])
        if len(found) > 1 and found[0][0] == found[1][0]:  # two names of one length (one type: priced once)
            raise UserInputError(
                f"{found[0][1].given} and {found[1][1].given}: both match {device_name} equally; keep one"
            )
        return found[0][1] if found else None

    def check(self, devices: Iterable[tuple[Optional[str], Optional[str]]], where: str) -> None:
        """Refuse a price that matches none of `devices` ((type, name) of the rows to price) and no published
        device, and two that match one device equally. `where` says what the rows are, for the message."""
        named = [(kind, name or "") for kind, name in devices]
        for kind, name in named:
            self.for_device(kind, name)
        for device in PUBLISHED_PRICE_NAMES:
            self.for_published(device)
        for price in self.entries:
            if any(price in [p for _, p in self._matches(kind, name)] for kind, name in named):
                continue
            if any(price.key in short.casefold() for short in PUBLISHED_PRICE_NAMES.values()):
                continue
            shown = ", ".join(sorted({f"{kind} ({name})" if kind else name for kind, name in named})) or "none"
            raise UserInputError(
                f"{price.given}: unknown device {price.device!r}: it matches no row ({where}: {shown}) and no published "
                f"device ({', '.join(PUBLISHED_PRICE_NAMES.values())}); a DEVICE is a device type or part of a device name"
            )

    def describe(self) -> str:
        return "; ".join(f"{p.device} = {p.usd_per_hour:g} USD per device-hour" for p in self.entries)


# ---------------------------------------------------------------------------------------------
# Reading prices
# ---------------------------------------------------------------------------------------------


def _price_value(text: object, given: str) -> float:
    if text is None or not str(text).strip():
        raise UserInputError(f"{given}: the price is missing (a number of USD per device-hour)")
    try:
        value = float(str(text).strip())
    except ValueError:
        raise UserInputError(f"{given}: {str(text).strip()!r} is not a number (USD per device-hour)") from None
    if math.isnan(value) or math.isinf(value):
        raise UserInputError(f"{given}: {text!r} is not a finite number (USD per device-hour)")
    if value < 0:
        raise UserInputError(f"{given}: a price must be 0 or more, got {value:g}")
    return value


def _device_name(text: object, given: str) -> str:
    name = str(text).strip() if text is not None else ""
    if not name:
        raise UserInputError(f"{given}: the device is empty (expected DEVICE=USD_PER_HOUR, e.g. H100=2.50)")
    return name


def parse_price(text: str) -> Price:
    """`DEVICE=USD_PER_HOUR` (`--price`)."""
    given = f"--price {text}"
    device, eq, value = text.rpartition("=")
    if not eq:
        raise UserInputError(f"{given}: expected DEVICE=USD_PER_HOUR (e.g. --price H100=2.50)")
    return Price(_device_name(device, given), _price_value(value, given), given)


def read_prices_file(path: str) -> list[Price]:
    """A JSON object {DEVICE: USD_PER_HOUR} (.json) or a CSV file with the columns device,usd_per_hour (.csv)."""
    flag = f"--prices {path}"
    file = Path(path)
    try:
        text = read_regular_file(file).decode()  # a FIFO is refused, never waited on
    except FileNotFoundError:
        raise UserInputError(f"{flag}: no such file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise UserInputError(f"{flag}: cannot be read ({getattr(error, 'strerror', None) or error})") from None
    suffix = file.suffix.lower()
    if suffix == ".json":
        try:
            content = json.loads(text)
        except json.JSONDecodeError as error:
            raise UserInputError(f"{flag}: not valid JSON ({error})") from None
        if not isinstance(content, dict):
            raise UserInputError(
                f'{flag}: expected a JSON object {{"DEVICE": USD_PER_HOUR, ...}}, found {type(content).__name__}'
            )
        return [
            Price(_device_name(k, f"{flag} key {k!r}"), _price_value(v, f"{flag} key {k!r}"), f"{flag} key {k!r}")
            for k, v in content.items()
        ]
    if suffix == ".csv":
        reader = csv.DictReader(text.splitlines())
        columns = [c.strip() for c in reader.fieldnames or []]
        if "device" not in columns or "usd_per_hour" not in columns:
            raise UserInputError(
                f"{flag}: expected the columns device,usd_per_hour (found: {','.join(columns) or 'nothing'})"
            )
        prices = []
        for line, row in enumerate(reader, start=2):
            row = {(k or "").strip(): v for k, v in row.items()}
            given = f"{flag} line {line}"
            prices.append(
                Price(_device_name(row.get("device"), given), _price_value(row.get("usd_per_hour"), given), given)
            )
        return prices
    raise UserInputError(f"{flag}: expected a .json or .csv file")


def prices_from_args(price_args: Optional[Sequence[str]], prices_file: Optional[str]) -> Prices:
    """Every --price and the --prices file, each DEVICE once."""
    entries = [parse_price(text) for text in price_args or []]
    if prices_file:
        entries += read_prices_file(prices_file)
    seen: dict = {}
    for price in entries:
        if price.key in seen:
            raise UserInputError(f"{price.given}: {price.device!r} is priced twice (also {seen[price.key].given})")
        seen[price.key] = price
    return Prices(entries)


def add_price_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--price",
        action="append",
        default=[],
        metavar="DEVICE=USD_PER_HOUR",
        help="Price of one device-hour, e.g. --price H100=2.50 --price cpu=0.10 (repeatable; DEVICE: a device "
        "type cpu/cuda/hpu or part of a device name, or a published device Gaudi2/H100/A100 80GB/Gaudi3). "
        "Adds USD per 1M training samples and the cost of the published run; no price is built in.",
    )
    parser.add_argument(
        "--prices",
        metavar="FILE",
        default=None,
        help='Prices from a file: a JSON object {"H100": 2.5} or a CSV file with the columns device,usd_per_hour.',
    )


def refuse(prog: str, error: Exception) -> NoReturn:
    """One line, `<prog>: error: <message>` (credential values redacted), exit status 2."""
    print(f"{prog}: error: {redact_text(str(error))}", file=sys.stderr)
    sys.exit(2)


# ---------------------------------------------------------------------------------------------
# Arithmetic
# ---------------------------------------------------------------------------------------------


def usd_per_million_samples(usd_per_device_hour: float, devices: int, samples_per_second: float) -> float:
    """USD per 1M training samples at `samples_per_second` (all `devices` together)."""
    return usd_per_device_hour * devices / (samples_per_second * 3600) * 1e6


def usd_published_experiment(
    usd_per_device_hour: float, devices: int, samples_per_second: float, samples: int = published.SAMPLES
) -> float:
    """USD of training the published experiment's samples at `samples_per_second` on `devices`."""
    return usd_per_device_hour * devices * samples / (samples_per_second * 3600)


def cost_fields(row: Mapping, prices: Prices) -> dict:
    """The cost columns of one results row (its device's price, and the costs when it has a speed); {} unpriced."""
    if not prices:
        return {}
    price = prices.for_device(row.get("device_type"), row.get("device_name"))
    if price is None:
        return {}
    fields = {"price_device": price.device, "usd_per_device_hour": price.usd_per_hour}
    speed, devices = row.get("train_samples_per_second"), row.get("world_size") or 1
    if isinstance(speed, (int, float)) and not isinstance(speed, bool) and speed > 0:
        fields["usd_per_1m_samples"] = usd_per_million_samples(price.usd_per_hour, devices, speed)
        fields["usd_published_experiment"] = usd_published_experiment(price.usd_per_hour, devices, speed)
    if row.get("per_node"):  # a run across nodes: each node's devices over its own samples
        fields["per_node"] = [
            {**node, "usd_per_1m_samples": usd_per_million_samples(price.usd_per_hour, node["processes"], rate)}
            if (rate := node.get("train_samples_per_second") or 0) > 0
            else node
            for node in row["per_node"]
        ]
    return fields
