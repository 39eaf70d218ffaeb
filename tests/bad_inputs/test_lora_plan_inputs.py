"""`loka lora-plan` with malformed jobs, model configs, throughput tables and options."""

from __future__ import annotations

import json

import polars as pl
import pytest


def _args(folder, *extra, jobs="jobs.json", model=None):
    return ("lora-plan", folder / jobs, "--model", model or folder, "--gpu-memory", "80GiB",
            *extra)  # fmt: skip


OPTIONS = [
    (("--gpu-memory", "0"), "--gpu-memory must be a positive size"),
    (("--gpu-memory", "0GiB"), "--gpu-memory must be a positive size"),
    (("--gpu-memory", "0.5"), "--gpu-memory must be a positive size"),
    (("--gpus", "0"), "--gpus must be in"),
    (("--gpus", "-2"), "--gpus must be in"),
    (("--gpus", "1000000"), "--gpus must be in"),
    (("--time-limit", "-1"), "--time-limit must be a positive number"),
    (("--time-limit", "0"), "--time-limit must be a positive number"),
    (("--time-limit", "nan"), "--time-limit must be a positive number"),
    (("--time-limit", "inf"), "--time-limit must be a positive number"),
    (("--max-pack-size", "0"), "--max-pack-size must be at least 1"),
    (("--max-pack-size", "-3"), "--max-pack-size must be at least 1"),
    (("--headroom", "0"), "--headroom is a fraction"),
    (("--headroom", "1.5"), "--headroom is a fraction"),
    (("--headroom", "-0.1"), "--headroom is a fraction"),
    (("--headroom", "nan"), "--headroom is a fraction"),
    (("--seq-len", "0"), "--seq-len must be in"),
    (("--seq-len", "-512"), "--seq-len must be in"),
    (("--seq-len", str(2**31)), "--seq-len must be in"),
    (("--out", "schedule.txt"), "written as .csv, .parquet or .json"),
    (("--out", "schedule"), "written as .csv, .parquet or .json"),
    (("--seq-len", str(2**30)), "tokens per step"),  # batch 2 x 2^30 tokens
]


@pytest.mark.parametrize(("extra", "needle"), OPTIONS)
def test_options_out_of_range(loka, lora_files, extra, needle):
    assert needle in loka(*_args(lora_files, *extra))


def test_out_a_directory(loka, lora_files):
    (lora_files / "dir.csv").mkdir()
    assert "is a directory" in loka(*_args(lora_files, "--out", lora_files / "dir.csv"))


JOBS_TEXT = [
    ('[{"name": "a",', "malformed JSON"),
    ("[1, 2,]", "malformed JSON"),
    ("not json at all", "malformed JSON"),
    ("", "malformed JSON"),
    ("{}", "expected a non-empty list of jobs"),
    ("[]", "expected a non-empty list of jobs"),
    ("42", "expected a non-empty list of jobs"),
    ('"jobs"', "expected a non-empty list of jobs"),
    ('{"jobs": 3}', "expected a non-empty list of jobs"),
    ('{"jobs": []}', "expected a non-empty list of jobs"),
    ("[1]", "job 0 is not an object"),
    ('[["a", 8]]', "job 0 is not an object"),
    ("[null]", "job 0 is not an object"),
]


@pytest.mark.parametrize(("text", "needle"), JOBS_TEXT)
def test_malformed_job_files_name_the_file(loka, lora_files, text, needle):
    (lora_files / "bad.json").write_text(text)
    line = loka(*_args(lora_files, jobs="bad.json"))
    assert "bad.json" in line and needle in line


BAD_JOBS = [
    ({"rank": 0}, "rank must be an integer >= 1"),
    ({"rank": -8}, "rank must be an integer >= 1"),
    ({"rank": 1.5}, "rank must be an integer >= 1"),
    ({"rank": "8"}, "rank must be an integer >= 1"),
    ({"rank": 2**40}, "is not a LoRA rank"),
    ({"alpha": 0}, "alpha must be a finite number > 0"),
    ({"alpha": -16}, "alpha must be a finite number > 0"),
    ({"alpha": "x"}, "alpha"),
    ({"lr": 0}, "lr must be a finite number > 0"),
    ({"lr": -1e-4}, "lr must be a finite number > 0"),
    ({"lr": 1e400}, "lr must be a finite number > 0"),
    ({"batch_size": 0}, "batch_size must be an integer >= 1"),
    ({"batch_size": -1}, "batch_size must be an integer >= 1"),
    ({"batch_size": 1e12}, "tokens per step"),
    ({"batch_size": 10**12}, "tokens per step"),
    ({"batch_size": 2**23}, "tokens per step"),
    ({"steps": 0}, "steps must be an integer >= 1"),
    ({"steps": -10}, "steps must be an integer >= 1"),
    ({"steps": 2.5}, "steps must be an integer >= 1"),
    ({"steps": None, "tokens": -5}, "tokens must be an integer >= 1"),
    ({"steps": None}, "give exactly one of steps and tokens"),
    ({"tokens": 1000}, "give exactly one of steps and tokens"),
    ({"weight_decay": -0.1}, "weight_decay must be >= 0"),
    ({"beta1": 1.0}, "beta1 must be in [0, 1)"),
    ({"beta2": -0.5}, "beta2 must be in [0, 1)"),
    ({"max_grad_norm": 0}, "max_grad_norm must be > 0"),
    ({"name": ""}, "name"),
    ({"name": "a b/c"}, "name"),
    ({"name": 7}, "name"),
    ({"unknown_key": 1}, "unknown_key"),
]


@pytest.mark.parametrize(("change", "needle"), BAD_JOBS)
def test_impossible_job_values_name_the_file_and_the_field(
    loka, lora_files, lora_job, change, needle
):
    job = {k: v for k, v in {**lora_job, **change}.items() if v is not None}
    (lora_files / "bad.json").write_text(json.dumps([job]))
    line = loka(*_args(lora_files, jobs="bad.json"))
    assert "bad.json" in line and needle in line


def test_a_missing_required_field(loka, lora_files, lora_job):
    job = {k: v for k, v in lora_job.items() if k != "rank"}
    (lora_files / "bad.json").write_text(json.dumps([job]))
    assert "rank" in loka(*_args(lora_files, jobs="bad.json"))


def test_duplicate_job_names(loka, lora_files, lora_job):
    (lora_files / "bad.json").write_text(json.dumps([lora_job, lora_job]))
    assert "job names must be unique" in loka(*_args(lora_files, jobs="bad.json"))


@pytest.mark.parametrize(
    ("name", "text", "needle"),
    [
        ("jobs.yaml", "- name: a\n  rank: [8\n", "malformed YAML"),
        ("jobs.yaml", "just a string\n", "expected a non-empty list"),
        ("jobs.csv", 'name,rank\n"a,8\n', "jobs.csv"),
        ("jobs.csv", "name,rank,alpha,lr,batch_size,steps\na,0,16,0.0001,2,10\n", "rank"),
        ("jobs.txt", "whatever", "are .json, .yaml/.yml or .csv"),
        ("jobs.json", b"\xff\xfe\x00garbage", "jobs.json"),
    ],
)
def test_other_job_formats(loka, lora_files, name, text, needle):
    path = lora_files / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    line = loka(*_args(lora_files, jobs=name))
    assert needle in line and name in line


def test_a_missing_job_file(loka, lora_files):
    assert "does not exist" in loka(*_args(lora_files, jobs="absent.json"))


BAD_MODELS = [
    ({"num_attention_heads": 0}, "num_attention_heads must be an integer"),
    ({"num_attention_heads": -4}, "num_attention_heads must be an integer"),
    ({"hidden_size": 0}, "hidden_size must be an integer"),
    ({"hidden_size": "256"}, "hidden_size must be an integer"),
    ({"hidden_size": 256.5}, "hidden_size must be an integer"),
    ({"num_hidden_layers": -1}, "num_hidden_layers must be an integer"),
    ({"intermediate_size": None}, "intermediate_size must be an integer"),
    ({"vocab_size": 2**40}, "vocab_size must be an integer"),
    ({"head_dim": -64}, "head_dim must be an integer"),
    ({"num_key_value_heads": "two"}, "num_key_value_heads must be an integer"),
    ({"num_hidden_layers": True}, "num_hidden_layers must be an integer"),
]


@pytest.mark.parametrize(("change", "needle"), BAD_MODELS)
def test_impossible_model_configs_name_the_file(loka, lora_files, lora_model, change, needle):
    model = lora_files / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**lora_model, **change}))
    line = loka(*_args(lora_files, model=model))
    assert "config.json" in line and needle in line


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("{", "malformed JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"hidden_size": 256}', "lacks"),
        ("", "malformed JSON"),
    ],
)
def test_malformed_model_configs(loka, lora_files, text, needle):
    model = lora_files / "model"
    model.mkdir()
    (model / "config.json").write_text(text)
    line = loka(*_args(lora_files, model=model))
    assert "config.json" in line and needle in line


def test_a_missing_model(loka, lora_files):
    assert "does not exist" in loka(*_args(lora_files, model=lora_files / "nowhere"))


STEPS = {"n_adapters": [1, 2, 4], "tokens": [1024, 2048, 4096], "rank_tokens": [8e3, 3e4, 6e4]}


@pytest.mark.parametrize(
    ("name", "content", "needle"),
    [
        ("steps.csv", "n_adapters,tokens\n1,1024\n", "lacks columns"),
        ("steps.csv", 'n_adapters,"tokens\n1', "lacks columns"),
        ("steps.json", "{not json", "cannot read the throughput table"),
        ("steps.parquet", b"PAR1 not parquet PAR1", "cannot read the throughput table"),
        ("steps.txt", "x", "are .csv, .json or .parquet"),
        ("steps.csv", {**STEPS, "step_time_s": [0.01, -0.02, 0.03]}, "step_time_s must be > 0"),
        ("steps.csv", {**STEPS, "step_time_s": [0.01, float("nan"), 0.03]}, "step_time_s"),
        ("steps.csv", {k: v[:1] for k, v in {**STEPS, "step_time_s": [0.1]}.items()}, "at least 2"),
    ],
)
def test_bad_throughput_tables_name_the_file(loka, lora_files, name, content, needle):
    path = lora_files / name
    if isinstance(content, dict):
        pl.DataFrame(content).write_csv(path)
    else:
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    line = loka(*_args(lora_files, "--throughput", path))
    assert needle in line and name in line


def test_a_missing_throughput_table(loka, lora_files):
    line = loka(*_args(lora_files, "--throughput", lora_files / "absent.csv"))
    assert "does not exist" in line
