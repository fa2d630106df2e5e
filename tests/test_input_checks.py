"""verl_replay.input_checks: each bad input is one line naming the key and the path."""

from __future__ import annotations

import sqlite3

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from verl_replay.input_checks import (
    PreflightError,
    check_archive_file,
    check_data_files,
    check_model_dir,
    check_sql_databases,
    check_tokenizer,
    is_hub_id,
)


def write_rows(path, rows, columns=("prompt", "data_source", "extra_info")):
    table = {name: [row.get(name) for row in rows] for name in columns}
    pq.write_table(pa.table(table), path)
    return path


def sqlite_db(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(path) as connection:
        connection.execute("CREATE TABLE t (x INTEGER)")
    return path


def prompt(text="q"):
    return [{"role": "user", "content": text}]


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_existing_parquet_files_pass_as_a_path_or_a_list(tmp_path):
    a = write_rows(tmp_path / "a.parquet", [{"prompt": prompt(), "data_source": "tiny_math", "extra_info": {"i": 1}}])
    b = write_rows(tmp_path / "b.parquet", [{"prompt": prompt(), "data_source": "tiny_math", "extra_info": {"i": 2}}])
    assert check_data_files("data.train_files", str(a)) == [a]
    assert check_data_files("data.val_files", [str(a), str(b)]) == [a, b]
    assert check_data_files("data.train_files", ["hdfs://cluster/x.parquet"]) == []  # left to verl


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda d: d / "missing.parquet", "missing.parquet does not exist"),
        (lambda d: d, "is a directory, not a parquet file"),
        (
            lambda d: (d / "x.parquet").write_text("not parquet") and d / "x.parquet",
            "x.parquet is not a readable parquet file",
        ),
    ],
)
def test_a_bad_data_file_names_the_key_and_the_path(tmp_path, make, expected):
    path = make(tmp_path)
    with pytest.raises(PreflightError) as error:
        check_data_files("data.train_files", [str(path)])
    assert one_line(error).startswith(f"data.train_files: {path}") and expected in str(error.value)


def test_a_data_file_without_the_prompt_column(tmp_path):
    path = write_rows(tmp_path / "a.parquet", [{"question": "q"}], columns=("question",))
    with pytest.raises(PreflightError, match=r"has no 'prompt' column \(data.prompt_key\); columns: question"):
        check_data_files("data.val_files", str(path))
    assert check_data_files("data.val_files", str(path), prompt_key="question") == [path]
    with pytest.raises(PreflightError, match="data.val_files is empty"):
        check_data_files("data.val_files", [])


def test_sql_rows_need_their_database(tmp_path):
    good = sqlite_db(tmp_path / "db" / "shop" / "shop.sqlite")
    rows = [
        {"prompt": prompt(), "data_source": "tiny_sql", "extra_info": {"db_path": str(good)}},
        {
            "prompt": prompt(),
            "data_source": "bird",
            "extra_info": {"db_path": "shop/shop.sqlite", "db_root": str(tmp_path / "db")},
        },
        {"prompt": prompt(), "data_source": "tiny_math", "extra_info": {"db_path": None}},  # not SQL
    ]
    path = write_rows(tmp_path / "sql.parquet", rows)
    assert check_sql_databases("data.train_files", [path]) == 1  # one distinct file, two spellings

    missing = write_rows(
        tmp_path / "missing.parquet",
        rows
        + [{"prompt": prompt(), "data_source": "spider", "extra_info": {"db_path": str(tmp_path / "gone.sqlite")}}],
    )
    with pytest.raises(PreflightError) as error:
        check_sql_databases("data.val_files", [missing])
    assert one_line(error) == (
        f"data.val_files: {missing} row 3 names the database {tmp_path / 'gone.sqlite'}, "
        "which does not exist (prepare the data where the databases are)"
    )


def test_a_sql_row_without_db_path_or_with_a_non_sqlite_file(tmp_path):
    path = write_rows(tmp_path / "a.parquet", [{"prompt": prompt(), "data_source": "spider", "extra_info": {"x": 1}}])
    with pytest.raises(PreflightError, match=r"row 0 \(data_source 'spider'\) has no extra_info.db_path"):
        check_sql_databases("data.train_files", [path])
    (tmp_path / "fake.sqlite").write_text("CREATE TABLE t (x);")
    path = write_rows(
        tmp_path / "b.parquet",
        [{"prompt": prompt(), "data_source": "sql_x", "extra_info": {"db_path": str(tmp_path / "fake.sqlite")}}],
    )
    with pytest.raises(PreflightError, match=r"fake.sqlite, which is not an SQLite database file"):
        check_sql_databases("data.train_files", [path])


def test_math_files_have_no_databases_to_check(tmp_path):
    path = write_rows(tmp_path / "m.parquet", [{"prompt": prompt()}], columns=("prompt",))
    assert check_sql_databases("data.train_files", [path]) == 0


def test_model_dir(tmp_path):
    with pytest.raises(PreflightError, match=f"actor_rollout_ref.model.path: {tmp_path / 'nope'} does not exist"):
        check_model_dir("actor_rollout_ref.model.path", str(tmp_path / "nope"))
    with pytest.raises(PreflightError, match="has no config.json"):
        check_model_dir("actor_rollout_ref.model.path", str(tmp_path))
    with pytest.raises(PreflightError, match="is required"):
        check_model_dir("actor_rollout_ref.model.path", None)
    (tmp_path / "config.json").write_text("{}")
    assert check_model_dir("actor_rollout_ref.model.path", str(tmp_path)) == tmp_path
    assert check_model_dir("actor_rollout_ref.model.path", "Qwen/Qwen3.5-4B") is None  # a hub id
    assert is_hub_id("Qwen/Qwen3.5-4B") and not is_hub_id(str(tmp_path)) and not is_hub_id("a/b/c")


def test_tokenizer_loads_or_names_the_folder(tmp_path, tiny_assets):
    assert check_tokenizer("actor_rollout_ref.model.path", str(tiny_assets.model_dir)).eos_token == "<|im_end|>"
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(PreflightError) as error:
        check_tokenizer("actor_rollout_ref.model.tokenizer_path", str(tmp_path))
    assert one_line(error).startswith(f"actor_rollout_ref.model.tokenizer_path: no tokenizer loads from {tmp_path}")


def test_archive_file(tmp_path):
    with pytest.raises(PreflightError) as error:
        check_archive_file("replay.elite.archive", str(tmp_path / "a.parquet"))
    assert one_line(error).startswith(f"replay.elite.archive: {tmp_path / 'a.parquet'} does not exist")
    assert "python -m verl_replay.elite.search --tiny --out" in str(error.value)
    (tmp_path / "a.parquet").write_bytes(b"x")
    assert check_archive_file("replay.elite.archive", str(tmp_path / "a.parquet")) == tmp_path / "a.parquet"
