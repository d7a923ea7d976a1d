"""pilotrun/data/choice_tasks.py: task files read in order, identified by sha256, refused with the line
named."""

from __future__ import annotations

import json

import pytest

from pilotrun.common.errors import DataError
from pilotrun.common.files import sha256_of_file
from pilotrun.data.choice_tasks import chance_accuracy, read_choice_task, read_choice_tasks
from tests.choice_task_fixture import continuation_examples, fineweb_texts, write_task


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_a_task_is_its_examples_in_file_order_named_by_stem_and_identified_by_sha256(tmp_path):
    path = _write(
        tmp_path / "tiny.jsonl",
        [
            json.dumps({"context": "a", "choices": [" b", " c"], "label": 1}),
            "",
            json.dumps({"context": "d", "choices": [" e", " f", " g"], "label": 0, "source": "kept out"}),
        ],
    )
    task = read_choice_task(path)
    assert (task.name, task.sha256) == ("tiny", sha256_of_file(path))
    assert [e.label for e in task.examples] == [1, 0] and task.examples[1].choices == (" e", " f", " g")
    assert task.first(1) == task.examples[:1] and task.first(0) == task.examples
    assert task.identity(1) == {"task": "tiny", "sha256": task.sha256, "examples": 1}
    assert chance_accuracy(task.examples) == (1 / 2 + 1 / 3) / 2


@pytest.mark.parametrize(
    "line, named",
    [
        ("not json", "line 2: not JSON"),
        ("[1, 2]", "line 2: expected a JSON object"),
        (json.dumps({"choices": [" a", " b"], "label": 0}), "line 2: 'context' must be a string"),
        (
            json.dumps({"context": "x", "choices": [" a"], "label": 0}),
            "line 2: 'choices' must be a list of at least two",
        ),
        (json.dumps({"context": "x", "choices": [" a", ""], "label": 0}), "line 2: 'choices'"),
        (
            json.dumps({"context": "x", "choices": [" a", " b"], "label": 2}),
            "line 2: 'label' must be an integer index",
        ),
        (json.dumps({"context": "x", "choices": [" a", " b"], "label": True}), "line 2: 'label'"),
    ],
)
def test_a_malformed_line_is_refused_naming_file_and_line(tmp_path, line, named):
    path = _write(
        tmp_path / "bad.jsonl", [json.dumps({"context": "a", "choices": [" b", " c"], "label": 0}), line]
    )
    with pytest.raises(DataError, match=named) as caught:
        read_choice_task(path)
    assert str(path) in str(caught.value) and "\n" not in str(caught.value)


def test_missing_empty_wrong_suffix_not_utf8_and_duplicate_names_are_refused(tmp_path):
    with pytest.raises(DataError, match="not found"):
        read_choice_task(tmp_path / "absent.jsonl")
    with pytest.raises(DataError, match="holds no example"):
        read_choice_task(_write(tmp_path / "empty.jsonl", [""]))
    with pytest.raises(DataError, match="expected a .jsonl file"):
        read_choice_task(_write(tmp_path / "task.txt", ["{}"]))
    (tmp_path / "bytes.jsonl").write_bytes(b"\xff\xfe\n")
    with pytest.raises(DataError, match="not UTF-8"):
        read_choice_task(tmp_path / "bytes.jsonl")
    good = json.dumps({"context": "a", "choices": [" b", " c"], "label": 0})
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    one, two = _write(tmp_path / "a" / "same.jsonl", [good]), _write(tmp_path / "b" / "same.jsonl", [good])
    with pytest.raises(DataError, match="share a name.*same"):
        read_choice_tasks([str(one), str(two)])


@pytest.mark.shared_fixtures
def test_the_fineweb_task_is_deterministic_and_its_choices_are_the_true_words_shuffled(tmp_path):
    first = write_task(tmp_path / "one" / "t.jsonl", continuation_examples(fineweb_texts(), 12))
    second = write_task(tmp_path / "two" / "t.jsonl", continuation_examples(fineweb_texts(), 12))
    assert first.read_bytes() == second.read_bytes()
    task = read_choice_task(first)
    assert [e.label for e in task.examples] == [i % 4 for i in range(12)]
    for example in task.examples:
        true = example.choices[example.label]
        assert true.startswith(" ") and len(set(example.choices)) == 4
        assert all(sorted(c.split()) == sorted(true.split()) for c in example.choices)


def test_a_context_or_choice_past_the_text_bound_is_refused_before_any_tokenizer_sees_it(tmp_path):
    from pilotrun.data.choice_tasks import MAX_TEXT_CHARS

    task = tmp_path / "huge.jsonl"
    task.write_text(
        json.dumps({"context": "a" * (MAX_TEXT_CHARS + 1), "choices": [" b", " c"], "label": 0})
        + "\n"
        + json.dumps({"context": "a", "choices": [" b", " c"], "label": 0})
        + "\n"
    )
    with pytest.raises(DataError) as refused:
        read_choice_task(task)
    said = str(refused.value)
    assert said.startswith(f"task file {task} line 1: a text of 1,048,577 characters; at most 1,048,576")
    assert "\n" not in said
    task.write_text(json.dumps({"context": "a" * MAX_TEXT_CHARS, "choices": [" b", " c"], "label": 0}) + "\n")
    assert len(read_choice_task(task).examples[0].context) == MAX_TEXT_CHARS  # at the bound: read
