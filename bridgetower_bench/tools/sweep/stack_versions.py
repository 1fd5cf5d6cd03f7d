"""Which Hugging Face stack each run ran, and whether runs put side by side ran the same one.

Every run record names the transformers, accelerate and datasets versions it ran (`version_transformers`,
`version_accelerate`, `version_datasets`: run_record.software_versions). The kit installs two routes with
different versions of these (README: the pinned one, like for like with Gaudi, and the current one), so the
sweep's report and `compare` say when the rows they show did not all run the same.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Optional


STACK_KEYS = ("version_transformers", "version_accelerate", "version_datasets")


def differing_versions(records: Iterable[Mapping], keys: tuple = STACK_KEYS) -> list[str]:
    """'transformers 4.50.0 / 5.0.0' for each library (each of `keys`) whose recorded version is not the same in
    every record (versions in the order first seen; a record that names none is not counted)."""
    records = list(records)
    differing = []
    for key in keys:
        versions = list(dict.fromkeys(str(r[key]) for r in records if r.get(key) is not None))
        if len(versions) > 1:
            differing.append(f"{key.removeprefix('version_')} {' / '.join(versions)}")
    return differing


def versions_note(records: Iterable[Mapping]) -> Optional[str]:
    """One sentence when the records ran different library versions, else None."""
    differing = differing_versions(records)
    if not differing:
        return None
    return (
        f"Not like for like: these runs ran different library versions ({'; '.join(differing)}); "
        "see each run's version_* fields."
    )
