"""bench/quality/reward_audit.py: a sheet of completions a person read, scored against the math reward by hand."""

import json

from bench.quality.reward_audit import main, sample, score


def _row(completion, answer, reader, reward):
    return {"completion": completion, "answer": answer, "reader_answer": reader, "reward": reward}


def test_a_misread_is_a_score_the_persons_reading_would_not_give():
    rows = [
        _row("5 + 3 = 8. So the answer is 8.", "8", "8", 1.0),  # read alike, scored alike
        _row("The answer is 8.", "9", "8", 0.0),  # read alike, both wrong
        # the reward takes the last number (7), a person reads 12 and scores it right: a misread
        _row("12 apples. There were 7 baskets.", "12", "12", 0.0),
        # no stated answer to a person; the reward reads 4, which is wrong anyway: readings differ, same score
        _row("I am not sure about 4 things.", "5", None, 0.0),
        # the run recorded 1.0 where a person reads a wrong answer: a misread as recorded only
        _row("So, 3 + 4 = 7.", "8", "7", 1.0),
    ]
    result = score(rows)
    assert result["rows"] == 5
    assert result["misread_rows"] == [2] and result["misread"] == 1 and result["misread_rate"] == 0.2
    assert result["readings_differ_same_score"] == [3]
    assert result["misread_as_recorded_rows"] == [2, 4]


def test_sample_spreads_the_draw_over_the_files_and_records_todays_reading(tmp_path):
    files = []
    for name, count in (("a", 5), ("b", 7)):
        path = tmp_path / f"{name}.jsonl"
        lines = [
            {"prompt": f"{name}{i}", "completion": f"so the answer is {i}", "answer": str(i), "reward": 1.0}
            for i in range(count)
        ]
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        files.append(path)
    rows = sample(files, 5, seed=1)
    assert [r["prompt"][0] for r in rows] == ["a", "a", "a", "b", "b"]
    assert all(r["extracted_answer"] == r["prompt"][1:] and r["rule"] == "statement" for r in rows)
    assert rows == sample(files, 5, seed=1)
    out = tmp_path / "sheet.jsonl"
    assert main(["sample", *map(str, files), "--count", "4", "--out", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 4
