"""store/SCHEMA.md stays true: it names every array, dim and root attribute of schema v1."""
from pathlib import Path

import pytest

from orthosphere.store import schema
from orthosphere.store.reader import REQUIRED_ATTRS

DOC = (Path(__file__).resolve().parents[1] / "store" / "SCHEMA.md").read_text()
ARRAYS = {**schema.TOKEN_VARIABLES, **schema.SITE_VARIABLES, **schema.WEIGHT_VARIABLES}


@pytest.mark.parametrize("name", sorted(ARRAYS))
def test_every_array_is_documented_with_its_dims(name):
    dims = "(" + ", ".join(ARRAYS[name].dims) + ")"
    assert f"| `{name}` | {dims} |" in DOC


@pytest.mark.parametrize("dim", sorted({d for var in ARRAYS.values() for d in var.dims}))
def test_every_dim_is_documented(dim):
    assert f"`{dim}`" in DOC


@pytest.mark.parametrize("attribute", REQUIRED_ATTRS + ("with_weights", "samples_per_chunk", "codec", "complete"))
def test_every_root_attribute_is_documented(attribute):
    assert f"`{attribute}`" in DOC


def test_schema_version_matches():
    assert f"schema version {schema.SCHEMA_VERSION}" in DOC


@pytest.mark.parametrize("key", schema.MODEL_KEYS + schema.SCORE_KEYS + schema.NORM_KEYS + schema.NORM_SITES
                         + schema.NORM_SCOPES + schema.NORM_PLACEMENTS)
def test_every_key_of_the_model_description_is_documented(key):
    assert f"`{key}`" in DOC
