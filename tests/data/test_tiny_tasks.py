"""The tiny search and image tasks: their rows, corpus, tool config, trajectories and cache."""

from __future__ import annotations

import asyncio
import io
import json
import random

import pandas as pd
import pytest

from verl_replay.data import tiny_tasks as tt


def test_every_search_question_is_answered_by_its_document():
    from verl_replay.search.index import BM25Index

    facts = tt.search_facts()
    assert len({code for _, code in facts}) == len(facts) and all(10 <= code < 100 for _, code in facts)
    index = BM25Index(tt.search_corpus(facts))
    for thing, code in facts:
        ((top, _),) = index.search([thing], 1)[0]
        assert f"The code of the {thing} is {code}." in top.contents
    assert tt.search_facts(seed=1) != facts


def test_the_tool_call_is_what_verls_hermes_parser_extracts(tiny_assets):
    from transformers import AutoTokenizer
    from verl.experimental.agent_loop.tool_parser import ToolParser

    tok = AutoTokenizer.from_pretrained(tiny_assets.model_dir)
    parser = ToolParser.get_tool_parser("hermes", tok)
    ids = tok.encode(tt.tool_call_text("zib"), add_special_tokens=False)
    _, calls = asyncio.run(parser.extract_tool_calls(ids, None))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("search", {"query": "zib"})]


def test_trajectories_train_on_the_assistant_turns_only(tiny_assets):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_assets.model_dir)
    facts = tt.search_facts()[:2]
    (ids, mask), _ = tt.search_trajectories(tok, facts)
    trained = tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert trained == tt.tool_call_text(facts[0][0]) + "<|im_end|>" + f"\\boxed{{{facts[0][1]}}}<|im_end|>"
    untrained = tok.decode([t for t, m in zip(ids, mask, strict=True) if not m])
    assert "Doc 1(Title: " in untrained and tt.search_question(facts[0][0]) in untrained


def test_square_pictures_hold_the_count_they_answer():
    import numpy as np
    from PIL import Image

    rng = random.Random(0)
    for count in (1, 2, 3, 4):
        picture = np.asarray(Image.open(io.BytesIO(tt.square_image(count, rng))).convert("RGB"))
        assert picture.shape == (64, 64, 3)
        coloured = (picture != 255).any(axis=-1)
        quadrants = [coloured[y : y + 32, x : x + 32].any() for y in (0, 32) for x in (0, 32)]
        assert sum(quadrants) == count


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_assets):
    """A copy of the tiny assets' model folder in a tmp root: the tasks are built next to it."""
    import shutil
    from dataclasses import replace

    root = tmp_path_factory.mktemp("tasks") / "tiny-v3"
    shutil.copytree(tiny_assets.model_dir, root / "model")
    return replace(tiny_assets, root=root, model_dir=root / "model")


def test_the_search_task_is_built_once_then_reused_and_rebuilt_when_a_file_changes(base):
    built = tt.build_tiny_task("search", base, warm_start_steps=1)
    assert built.built_now and built.root == base.root.parent / f"tiny-v3-search-t{tt.TASK_FORMAT_VERSION}"
    manifest = built.manifest()
    assert manifest["task"] == "search" and manifest["warm_start_steps"] == 1 and manifest["counts"]["train"] == 12
    train = pd.read_parquet(built.train)
    assert set(train["agent_name"]) == {"tool_agent"} and set(train["data_source"]) == {tt.TINY_SEARCH_SOURCE}
    tools = json.loads(built.tool_config.read_text())["tools"][0]
    assert tools["config"]["corpus_path"] == str(built.corpus) and built.corpus.is_file()
    assert not tt.build_tiny_task("search", base, warm_start_steps=1).built_now
    (built.root / "train.parquet").write_bytes(b"corrupt")  # a changed file is rebuilt
    assert tt.build_tiny_task("search", base, warm_start_steps=1).built_now
    with pytest.raises(ValueError, match="tiny task must be one of"):
        tt.build_tiny_task("video", base)


def test_the_image_task_holds_one_picture_per_row(base):
    built = tt.build_tiny_task("image", base, warm_start_steps=1)
    train = pd.read_parquet(built.train)
    assert all(len(images) == 1 for images in train["images"])
    assert train["prompt"][0][0]["content"].startswith("<image>") and set(train["data_source"]) == {
        tt.TINY_IMAGE_SOURCE
    }
    assert (built.model_dir / "preprocessor_config.json").is_file()  # the processor verl loads


def test_the_arith_task_validates_on_its_held_out_problems_with_the_larger_model(base):
    from transformers import AutoConfig

    from verl_replay.data import tiny_arith

    built = tt.build_tiny_task("arith", base, warm_start_steps=2)
    manifest = built.manifest()
    assert manifest["counts"] == {"train": tiny_arith.TRAIN_PROMPTS, "val": tiny_arith.HELD_OUT_PROMPTS}
    assert manifest["warm_start"]["teacher_noise"] == tiny_arith.TEACHER_NOISE
    assert manifest["warm_start"]["operands"] == [10, 100]
    train, val = pd.read_parquet(built.train), pd.read_parquet(built.val)
    questions = lambda rows: {row[0]["content"] for row in rows["prompt"]}  # noqa: E731
    assert not questions(train) & questions(val)
    assert set(train["data_source"]) == set(val["data_source"]) == {tiny_arith.TINY_ARITH_SOURCE}
    config = AutoConfig.from_pretrained(built.model_dir)
    assert config.architectures == ["Qwen3_5ForConditionalGeneration"]
    shape = tt.MODEL_SIZE["arith"]
    assert config.text_config.hidden_size == shape["hidden_size"]
    assert config.text_config.layer_types == list(shape["layer_types"])
    assert config.text_config.rope_parameters["rope_theta"] == shape["rope_theta"]
    # a different warm start is a different task build, not the cached one
    assert not tt.build_tiny_task("arith", base, warm_start_steps=2).built_now
    assert tt.build_tiny_task("arith", base, warm_start_steps=3).built_now


def test_the_shapes_task_holds_its_database_and_validates_on_held_out_questions(base):
    import sqlite3

    from transformers import AutoConfig

    from verl_replay.data import tiny_shapes
    from verl_replay.rewards import compute_score

    built = tt.build_tiny_task("shapes", base, warm_start_steps=2)
    manifest = built.manifest()
    assert manifest["counts"]["val"] == tiny_shapes.HELD_OUT and manifest["counts"]["train"] > tiny_shapes.HELD_OUT
    assert manifest["warm_start"]["shape_rates"] == list(tiny_shapes.SHAPE_RATES)
    assert f"databases/{tiny_shapes.DB_ID}/{tiny_shapes.DB_ID}.sqlite" in manifest["files"]
    train, val = pd.read_parquet(built.train), pd.read_parquet(built.val)
    questions = lambda rows: {row[0]["content"] for row in rows["prompt"]}  # noqa: E731
    assert not questions(train) & questions(val)
    # the rows name the database where the build was moved to, and every gold query is right there
    row = val.iloc[0]
    info = dict(row["extra_info"])
    assert info["db_path"] == str(built.database) and built.database.is_file()
    with sqlite3.connect(built.database) as conn:
        assert conn.execute("SELECT COUNT(*) FROM products").fetchone() == (tiny_shapes.PRODUCTS,)
    for sql in info["gold_sqls"]:
        assert compute_score(row["data_source"], sql, row["reward_model"]["ground_truth"], info)["acc"] == 1.0
    config = AutoConfig.from_pretrained(built.model_dir)
    assert config.text_config.hidden_size == tt.MODEL_SIZE["shapes"]["hidden_size"]
    assert not tt.build_tiny_task("shapes", base, warm_start_steps=2).built_now
