"""crest's top-level names (`crest/__init__.py`): each public name is what it says, the same object on every
access and after its subpackage is imported, and none is shadowed by a subpackage of the same name."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest

import crest


@pytest.mark.parametrize("name", [n for n in crest.__all__ if n != "__version__"])
def test_a_public_name_is_its_subpackages_object_on_every_access(name: str) -> None:
    first = getattr(crest, name)
    for package in ("crest.ingest", "crest.drafters", "crest.decoding", "crest.config"):
        importlib.import_module(package)  # importing a subpackage binds its name on crest
    again = getattr(crest, name)
    assert first is again and not isinstance(first, ModuleType)
    namespace: dict[str, object] = {}
    exec(f"from crest import {name}", namespace)  # noqa: S102  (the import a user writes)
    assert namespace[name] is first


def test_building_a_store_is_the_ingest_subpackages_function() -> None:
    from crest.ingest import ingest
    from crest.ingest.pipeline import ingest as defined

    assert isinstance(crest.ingest, ModuleType) and ingest is defined and callable(ingest)
