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


@pytest.mark.parametrize("key", schema.MODEL_KEYS + schema.SCORE_KEYS + schema.OPTIONAL_SCORE_KEYS + schema.NORM_KEYS
                         + schema.NORM_SITES
                         + schema.NORM_SCOPES + schema.NORM_PLACEMENTS)
def test_every_key_of_the_model_description_is_documented(key):
    assert f"`{key}`" in DOC


def transformer_lens_table() -> dict[str, tuple[str, str]]:
    """SCHEMA.md's TransformerLens table: site -> (hook, hook with rotary positions)."""
    section = DOC.split("## TransformerLens names", 1)[1].split("\n## ", 1)[0]
    rows = [line.split(" | ") for line in section.splitlines() if line.startswith("| `")]
    table = {}
    for site, hook, rotary, _relation in rows:
        hook = hook.strip("`")
        table[site.removeprefix("| ").strip("`")] = (hook, hook if rotary == "same" else rotary.strip("`"))
    return table


@pytest.mark.parametrize("positions", ["rotary", "learned"])
def test_every_site_carries_its_transformer_lens_hook_as_the_table_says(tmp_path, positions):
    from orthosphere.store import create_store, open_store

    table = transformer_lens_table()
    assert set(table) == set(schema.SITES)
    model = {"n_layers": 1, "d_model": 4, "n_heads": 2, "n_kv_heads": 1, "d_head": 2, "positions": positions}
    url = str(tmp_path / "store.zarr")
    writer = create_store(url, model=model, task={"name": "synthetic"}, n_samples=2, n_pos=3, sites=schema.SITES,
                          with_weights=False)
    writer.mark_shard_complete(0)
    writer.finish()
    store = open_store(url)
    for site in schema.SITES:
        assert store[site].attrs["transformer_lens"] == table[site][positions == "rotary"], site
    assert "transformer_lens" not in store["tokens"].attrs
