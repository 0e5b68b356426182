import json

import pytest

from everyprompt.data import DataError, PromptCursor, load_prompt_file


def test_jsonl_rows_are_normalised(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": 2, "level": 1}\n\n{"prompt": "2+2=", "answer": "4"}\n')
    rows = load_prompt_file(path)
    assert [r["answer"] for r in rows] == ["2", "4"]
    assert [r["level"] for r in rows] == [1, None]


def test_malformed_jsonl_row_reports_its_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": \n')
    with pytest.raises(DataError, match=r"p\.jsonl:2: not valid JSON"):
        load_prompt_file(path)


def test_missing_field_reports_line_and_fields(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"question": "2+2="}\n')
    with pytest.raises(DataError, match=r"p\.jsonl:2: missing field\(s\) \['prompt', 'answer'\]"):
        load_prompt_file(path)


def test_parquet_is_read(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["1+2="], "answer": ["3"]}), path)
    assert load_prompt_file(path)[0]["answer"] == "3"


def test_unsupported_or_missing_file(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_prompt_file(tmp_path / "none.jsonl")
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(DataError, match="unsupported"):
        load_prompt_file(tmp_path / "x.csv")


def test_cursor_covers_each_epoch_and_resumes():
    cursor = PromptCursor(5, seed=3)
    first = cursor.take(5)
    assert sorted(first) == [0, 1, 2, 3, 4]
    state = cursor.state_dict()
    expected = cursor.take(7)
    resumed = PromptCursor(5, seed=3)
    resumed.load_state_dict(state)
    assert resumed.take(7) == expected
    with pytest.raises(DataError, match="covers 5 prompts"):
        PromptCursor(6, seed=3).load_state_dict(state)


def test_columns_map_a_gsm8k_style_file(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    path.write_text(
        json.dumps({"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=7\n#### 7"})
    )
    [row] = load_prompt_file(path, {"prompt": "question", "solution": "answer"})
    assert row["prompt"].startswith("Tom has") and row["solution"] == row["answer"] == "3+4=7\n#### 7"
    assert row["question"] == row["prompt"]  # the file's own columns stay (reward functions may read them)


def test_a_missing_column_names_the_file_the_mapping_and_the_columns_it_has(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"question": "1+1=", "answer": "2"}\n')
    with pytest.raises(DataError) as err:
        load_prompt_file(path, {"prompt": "problem"})
    message = str(err.value)
    assert str(path) in message and "'problem'" in message and "data.columns.prompt" in message
    assert "['answer', 'question']" in message
    with pytest.raises(DataError, match=r"data.columns maps \['query'\]"):
        load_prompt_file(path, {"query": "question"})


def test_json_arrays_arrow_files_and_save_to_disk_directories_are_read(tmp_path):
    import pyarrow as pa

    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "2+2=", "answer": "4"}]
    (tmp_path / "a.json").write_text(json.dumps(rows))
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(tmp_path / "a.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)  # the IPC stream format `datasets` writes
    split = tmp_path / "train"
    split.mkdir()
    with pa.OSFile(str(split / "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
    for path in (tmp_path / "a.json", tmp_path / "a.arrow", split):
        assert [r["answer"] for r in load_prompt_file(path)] == ["3", "4"], path
    (tmp_path / "bad.json").write_text('[{"prompt": "1+2=", "answer": "3"},\n {"prompt": ]')
    with pytest.raises(DataError, match=r"bad\.json:2: not valid JSON"):
        load_prompt_file(tmp_path / "bad.json")


def test_messages_rows_take_their_prompt_from_the_last_user_turn(tmp_path):
    path = tmp_path / "chat.jsonl"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1="}]
    path.write_text(json.dumps({"messages": messages, "answer": "2"}) + "\n")
    [row] = load_prompt_file(path)
    assert row["prompt"] == "1+1=" and row["messages"] == messages
    path.write_text(json.dumps({"messages": [{"role": "user"}], "answer": "2"}) + "\n")
    with pytest.raises(DataError, match=r"chat\.jsonl:1: message 1 has no string `content`"):
        load_prompt_file(path)
