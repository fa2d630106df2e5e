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


@pytest.mark.parametrize("task", ["search", "image"])
def test_a_task_is_built_once_and_then_reused(tmp_path, tiny_assets, monkeypatch, task):
    import shutil

    base_root = tmp_path / "tiny-v3"
    shutil.copytree(tiny_assets.root, base_root)
    from dataclasses import replace

    base = replace(tiny_assets, root=base_root, model_dir=base_root / "model")
    built = tt.build_tiny_task(task, base, warm_start_steps=2)
    assert built.built_now and built.root == tmp_path / f"tiny-v3-{task}-t{tt.TASK_FORMAT_VERSION}"
    manifest = built.manifest()
    assert manifest["task"] == task and manifest["warm_start_steps"] == 2 and manifest["counts"]["train"] > 0
    train = pd.read_parquet(built.train)
    if task == "search":
        assert set(train["agent_name"]) == {"tool_agent"} and set(train["data_source"]) == {tt.TINY_SEARCH_SOURCE}
        tools = json.loads(built.tool_config.read_text())["tools"][0]
        assert tools["config"]["corpus_path"] == str(built.corpus) and built.corpus.is_file()
    else:
        assert all(len(images) == 1 for images in train["images"]) and train["prompt"][0][0]["content"].startswith(
            "<image>"
        )
    again = tt.build_tiny_task(task, base, warm_start_steps=2)
    assert not again.built_now
    (built.root / "train.parquet").write_bytes(b"corrupt")  # a changed file is rebuilt
    assert tt.build_tiny_task(task, base, warm_start_steps=2).built_now
    with pytest.raises(ValueError, match="tiny task must be one of"):
        tt.build_tiny_task("video", base)
