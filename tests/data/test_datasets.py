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
