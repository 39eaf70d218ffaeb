import os

import polars as pl
import pytest

from loka.schema import (
    SCHEMA_VERSION,
    TABLES,
    SchemaError,
    TableWriteError,
    empty,
    read_metadata,
    read_table,
    validate,
    write_table,
)


def _sites(**overrides) -> pl.DataFrame:
    row = {
        "site": ["mlp.0", "mlp.2"],
        "kind": ["linear", "linear"],
        "K": [128, 512],
        "N": [512, 1],
        "M_min": [64, 64],
        "M_p50": [64, 64],
        "M_max": [64, 64],
        "calls": [3, 3],
        "groups": [1, 1],
        "has_bias": [True, False],
        "dtype": ["bfloat16", "bfloat16"],
        "fwd_ms": [None, None],
        "bwd_ms": [None, None],
        "time_share": [0.25, None],
    }
    row.update(overrides)
    return pl.DataFrame(row)


def _plan() -> pl.DataFrame:
    return pl.DataFrame(
        {
            "site": ["a"],
            "pass": ["fwd"],
            "backend": ["torch.scaled_mm"],
            "recipe": ["e4m3:e4m3/row/dynamic"],
            "K": [1024],
            "N": [4096],
            "M_p50": [16384],
            "bf16_ms": [0.1],
            "predicted_ms": [0.07],
            "predicted_speedup": [0.1 / 0.07],
            "predicted_rel_err": [0.04],
            "budget": [0.06],
            "estimated": [True],
            "reason": ["fastest safe candidate"],
            "rejected": [
                [
                    {
                        "backend": "triton.fp8",
                        "recipe": "e4m3:e4m3/tensor/dynamic",
                        "reason": "unsafe",
                    }
                ]
            ],
        }
    )


def test_every_table_has_unique_columns_and_a_key_inside_it():
    for tbl in TABLES.values():
        assert len(set(tbl.names)) == len(tbl.names), tbl.name
        assert set(tbl.key) <= set(tbl.names), tbl.name
        for key in tbl.key:
            assert not tbl.column(key).nullable, (tbl.name, key)


def test_empty_tables_validate():
    for name in TABLES:
        assert validate(empty(name), name).schema == TABLES[name].schema


def test_roundtrip_keeps_values_types_and_metadata(tmp_path):
    path = write_table(_plan(), tmp_path / "plan.parquet", "plan", metadata={"model": "dlrm-tiny"})
    back = read_table(path, "plan")
    assert back.equals(validate(_plan(), "plan"))
    assert back["rejected"][0][0]["reason"] == "unsafe"
    assert read_metadata(path) == {"model": "dlrm-tiny"}


def test_widening_casts_are_accepted_and_canonicalized():
    df = _sites(
        K=pl.Series([128, 512], dtype=pl.Int32), time_share=pl.Series([0.5, 0.25], dtype=pl.Float32)
    )
    out = validate(df.select(reversed(df.columns)), "sites")
    assert out.columns == TABLES["sites"].names
    assert out.schema["K"] == pl.Int64 and out.schema["time_share"] == pl.Float64


def test_missing_column_names_source_column_and_versions():
    with pytest.raises(SchemaError) as err:
        validate(_sites().drop("K"), "sites", source="runs/sites.parquet")
    msg = str(err.value)
    assert "runs/sites.parquet" in msg and "'K'" in msg and f"version {SCHEMA_VERSION}" in msg


def test_wrong_type_is_refused_not_coerced():
    with pytest.raises(SchemaError, match="column 'K' has type String"):
        validate(_sites(K=["128", "512"]), "sites")
    with pytest.raises(SchemaError, match="column 'M_p50' has type Float64"):
        validate(_sites(M_p50=[64.5, 64.0]), "sites")


def test_nulls_vocabulary_and_duplicate_keys_are_refused():
    with pytest.raises(SchemaError, match="'calls' has 1 null"):
        validate(_sites(calls=[3, None]), "sites")
    with pytest.raises(SchemaError, match=r"holds \['conv'\]"):
        validate(_sites(kind=["linear", "conv"]), "sites")
    with pytest.raises(SchemaError, match="appears twice"):
        validate(_sites(site=["x", "x"]), "sites")


def test_reading_another_version_or_table_fails_clearly(tmp_path):
    path = tmp_path / "sites.parquet"
    validate(_sites(), "sites").write_parquet(
        path, metadata={"loka.table": "sites", "loka.schema_version": str(SCHEMA_VERSION + 1)}
    )
    with pytest.raises(SchemaError) as err:
        read_table(path, "sites")
    assert str(path) in str(err.value)
    assert f"schema version {SCHEMA_VERSION + 1}" in str(err.value)
    assert f"reads version {SCHEMA_VERSION}" in str(err.value)

    write_table(_sites(), path, "sites")
    with pytest.raises(SchemaError, match="holds table 'sites', expected 'plan'"):
        read_table(path, "plan")


def test_foreign_and_corrupt_files_fail_clearly(tmp_path):
    foreign = tmp_path / "foreign.parquet"
    pl.DataFrame({"x": [1]}).write_parquet(foreign)
    with pytest.raises(SchemaError, match="not a LoKA table"):
        read_table(foreign, "sites")
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(SchemaError, match="not a readable parquet file"):
        read_table(corrupt, "sites")
    with pytest.raises(FileNotFoundError):
        read_table(tmp_path / "absent.parquet", "sites")


def test_invalid_frame_never_reaches_disk(tmp_path):
    path = tmp_path / "sites.parquet"
    write_table(_sites(), path, "sites")
    before = path.read_bytes()
    with pytest.raises(SchemaError):
        write_table(_sites().drop("N"), path, "sites")
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["sites.parquet"]


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
def test_unwritable_place_fails_cleanly():
    # /proc refuses new files even for root, so this holds on CI machines that run as root.
    with pytest.raises(TableWriteError, match=r"cannot write /proc/sites\.parquet"):
        write_table(_sites(), "/proc/sites.parquet", "sites")


def test_missing_directory_fails_cleanly(tmp_path):
    with pytest.raises(TableWriteError, match="does not exist"):
        write_table(_sites(), tmp_path / "nope" / "sites.parquet", "sites")


def test_failure_during_write_leaves_old_file_and_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "sites.parquet"
    write_table(_sites(), path, "sites")
    before = path.read_bytes()

    def boom(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pl.DataFrame, "write_parquet", boom)
    with pytest.raises(TableWriteError, match="No space left"):
        write_table(_sites(time_share=[0.1, 0.2]), path, "sites")
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["sites.parquet"]


def test_version_1_files_migrate_and_version_0_is_refused(tmp_path):
    # A version-1 sites table (no `norm`) and plan (its `fuse_norm` an extra column, no
    # `norm`) read as the current version: the columns added since take their defaults.
    path = tmp_path / "sites.parquet"
    _sites().write_parquet(path, metadata={"loka.table": "sites", "loka.schema_version": "1"})
    sites = read_table(path, "sites")
    assert sites.columns == TABLES["sites"].names and sites["norm"].null_count() == 2
    assert sites["producer"].null_count() == sites["grad_producer"].null_count() == 2
    plan = tmp_path / "plan.parquet"
    validate(_plan(), "plan").drop("norm").write_parquet(
        plan, metadata={"loka.table": "plan", "loka.schema_version": "1"}
    )
    assert read_table(plan, "plan")["fuse_norm"].to_list() == [False]
    _sites().write_parquet(path, metadata={"loka.table": "sites", "loka.schema_version": "0"})
    with pytest.raises(
        SchemaError, match=f"schema version 0, this loka-schema reads version {SCHEMA_VERSION}"
    ):
        read_table(path, "sites")


def test_version_2_sites_read_with_no_producer(tmp_path):
    # Version 2 traced the norms but not the producers: its norms survive, producers are null.
    path = tmp_path / "sites.parquet"
    v2 = _sites().with_columns(pl.Series("norm", ["ln", None], dtype=pl.String))
    v2.write_parquet(path, metadata={"loka.table": "sites", "loka.schema_version": "2"})
    sites = read_table(path, "sites")
    assert sites["norm"].to_list() == ["ln", None]
    assert sites["producer"].to_list() == sites["grad_producer"].to_list() == [None, None]


def test_only_columns_added_after_version_1_may_be_missing():
    assert [c.name for c in TABLES["sites"].columns if c.optional] == [
        "norm",
        "producer",
        "grad_producer",
    ]
    out = validate(_sites(norm=["ln", None]), "sites")
    assert out["norm"].to_list() == ["ln", None]
    assert validate(_sites(), "sites")["norm"].to_list() == [None, None]
