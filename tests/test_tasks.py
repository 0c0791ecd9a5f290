"""The arithmetic task: format, arithmetic, labels, splits, determinism, bad input."""

import json

import numpy as np
import pytest

from orthosphere.extract import tasks
from orthosphere.extract.model import ConfigError

TWO_DIGITS = tasks.TaskSpec(train_counts=(2, 3, 5), interpolation_counts=(4,),
                            extrapolation_counts=(6, 7), digit_lengths=(1, 2))
"""A richer spec than the shipped one: numbers of one or two digits carry and borrow."""


def signed_operands(text: str) -> tuple[list[int], int]:
    """Parse ``[a+b-Nc=d]`` independently of the generator: signed terms and the answer."""
    assert text[0] == "[" and text[-1] == "]"
    left, answer = text[1:-1].split("=")
    terms, sign, number = [], 1, ""
    for char in left + "+":
        if char in "+-" and number:
            terms.append(sign * int(number.replace("N", "-")))
            sign, number = (-1 if char == "-" else 1), ""
        else:
            number += char
    return terms, int(answer.replace("N", "-"))


@pytest.mark.parametrize("spec", [tasks.DEFAULT_SPEC, TWO_DIGITS])
@pytest.mark.parametrize("split", tasks.SPLITS)
def test_every_answer_is_the_sum_and_counts_follow_the_split(split, spec):
    batch = tasks.generate(split, 300, seed=3, spec=spec)
    counts, lengths = set(), set()
    for i in range(len(batch)):
        terms, answer = signed_operands(batch.text(i))
        assert sum(terms) == answer
        counts.add(len(terms))
        lengths.update(len(str(abs(t))) for t in terms)
    assert counts == set(spec.counts(split))
    assert lengths == set(spec.digit_lengths)


def test_the_default_spec_is_the_papers_counts_with_one_digit_numbers():
    spec = tasks.DEFAULT_SPEC
    assert (spec.train_counts, spec.interpolation_counts, spec.extrapolation_counts) == (
        (3, 4, 6), (5,), (7, 8, 9))
    assert spec.digit_lengths == (1,)
    assert [spec.max_length(split) for split in tasks.SPLITS] == [23, 23, 20, 32]


def test_known_examples_of_the_format():
    spec = tasks.DEFAULT_SPEC
    batch = tasks.generate("train", 50, seed=0, spec=spec)
    texts = [batch.text(i) for i in range(len(batch))]
    assert any("N" in t.split("=")[0] for t in texts)  # negative operands occur
    assert any(t.split("=")[1].startswith("N") for t in texts)  # negative answers occur
    assert all(t.startswith("[") and t.endswith("]") and t.count("=") == 1 for t in texts)
    assert tasks.token_ids("[53+6-N17=76]") == [13, 5, 3, 10, 6, 11, 12, 1, 7, 14, 7, 6, 15]
    assert tasks.token_text([13, 5, 3, 14, 5, 3, 15, tasks.PAD_ID]) == "[53=53]"
    assert tasks.VOCAB_SIZE == 17


def test_same_examples_in_any_batch_size_or_shard():
    whole = tasks.generate("interpolation", 10, seed=7, spec=TWO_DIGITS)
    parts = [tasks.generate("interpolation", 4, seed=7, spec=TWO_DIGITS, start=0),
             tasks.generate("interpolation", 6, seed=7, spec=TWO_DIGITS, start=4)]
    for name in ("tokens", "valid", "target", "scored"):
        np.testing.assert_array_equal(getattr(whole, name),
                                      np.concatenate([getattr(p, name) for p in parts]))
    for name in tasks.LABEL_NAMES:
        np.testing.assert_array_equal(whole.labels[name],
                                      np.concatenate([p.labels[name] for p in parts]))
    other_seed = tasks.generate("interpolation", 10, seed=8, spec=TWO_DIGITS)
    assert not np.array_equal(whole.tokens, other_seed.tokens)
    test_split = tasks.generate("test", 10, seed=7)
    train_split = tasks.generate("train", 10, seed=7)
    assert not np.array_equal(test_split.tokens, train_split.tokens)


def test_shapes_padding_and_targets():
    batch = tasks.generate("extrapolation", 40, seed=1)
    length = tasks.DEFAULT_SPEC.max_length("extrapolation")
    assert batch.tokens.shape == (40, length) and batch.tokens.dtype == np.int32
    for array in (batch.valid, batch.target, batch.scored, *batch.labels.values()):
        assert array.shape == (40, length)
    np.testing.assert_array_equal(batch.valid, batch.tokens != tasks.PAD_ID)
    np.testing.assert_array_equal(batch.target[:, :-1], batch.tokens[:, 1:])
    assert (batch.target[:, -1] == tasks.PAD_ID).all()
    # padding only at the end of each row
    assert (np.diff(batch.valid.astype(int), axis=1) <= 0).all()
    assert batch.labels["carry"].dtype == np.int16


def test_scored_positions_predict_exactly_the_answer_and_its_end():
    batch = tasks.generate("test", 100, seed=2)
    for i in range(len(batch)):
        text = batch.text(i)
        equals = text.index("=")
        scored = np.flatnonzero(batch.scored[i])
        np.testing.assert_array_equal(scored, np.arange(equals, len(text) - 1))
        predicted = "".join(tasks.CHARACTERS[t] for t in batch.target[i, scored])
        assert predicted == text[equals + 1:]


@pytest.mark.parametrize("spec", [tasks.DEFAULT_SPEC, TWO_DIGITS])
def test_labels_describe_each_token(spec):
    batch = tasks.generate("train", 200, seed=4, spec=spec)
    labels = batch.labels
    for i in range(len(batch)):
        text = batch.text(i)
        width = len(text)
        assert "".join(labels["token_str"][i, :width]) == text
        assert (labels["token_str"][i, width:] == "").all()
        assert (labels["role"][i, width:] == "pad").all()
        roles = list(labels["role"][i, :width])
        equals = text.index("=")
        assert roles[0] == "bos" and roles[equals] == "equals" and roles[-1] == "eos"
        assert set(roles[equals + 1:-1]) == {"answer"}
        # each number: its operand index, places counted from the right
        numbers = text[1:equals].replace("+", " ").replace("-", " ").split()
        operand_of_digits = [labels["operand"][i, p] for p in range(width) if roles[p] == "digit"]
        expected = [k for k, number in enumerate(numbers) for _ in number.lstrip("N")]
        assert operand_of_digits == expected
        for position in range(width):
            char, role = text[position], roles[position]
            place, value = labels["digit_place"][i, position], labels["digit_value"][i, position]
            if char.isdigit():
                assert value == int(char)
                run_end = position
                while run_end + 1 < width and text[run_end + 1].isdigit():
                    run_end += 1
                assert place == run_end - position
            else:
                assert value == tasks.MISSING and place == tasks.MISSING
            if role == "sign":
                assert char == "N" and labels["operand"][i, position] >= 0
            if role == "operator":
                assert char in "+-" and labels["operand"][i, position] >= 1
            if role in ("bos", "equals", "answer", "eos"):
                assert labels["operand"][i, position] == tasks.MISSING
            if not (role == "answer" and char.isdigit()):
                assert labels["carry"][i, position] == tasks.MISSING


def test_carries_rebuild_every_answer_digit():
    """digit_p = (column sum_p + carry_p) mod 10 and carry_{p+1} = floor((column + carry_p) / 10),
    with the operands' signs taken relative to the answer's sign."""
    batch = tasks.generate("extrapolation", 200, seed=5, spec=TWO_DIGITS)
    seen = set()
    for i in range(len(batch)):
        text = batch.text(i)
        terms, answer = signed_operands(text)
        relative = [t if answer >= 0 else -t for t in terms]
        answer_positions = [p for p in range(len(text))
                            if batch.labels["role"][i, p] == "answer" and text[p].isdigit()]
        carries = {int(batch.labels["digit_place"][i, p]): int(batch.labels["carry"][i, p])
                   for p in answer_positions}
        digits = {int(batch.labels["digit_place"][i, p]): int(text[p]) for p in answer_positions}
        assert carries[0] == 0
        for place in sorted(digits):
            column = sum((1 if t >= 0 else -1) * (abs(t) // 10 ** place % 10) for t in relative)
            assert digits[place] == (column + carries[place]) % 10
            if place + 1 in carries:
                assert carries[place + 1] == (column + carries[place]) // 10
        seen.update(carries.values())
    assert min(seen) < 0 < max(seen)  # borrows and carries both occur
    assert max(seen) >= 2  # several operands can carry more than one


def test_carry_into_known_cases():
    assert tasks.carry_into(1, [58, 67]) == 1      # 8 + 7 = 15
    assert tasks.carry_into(2, [58, 67]) == 1      # 58 + 67 = 125
    assert tasks.carry_into(1, [52, -17]) == -1    # 2 - 7: a borrow
    assert tasks.carry_into(1, [17, -52]) == -1    # answer -35 written as 52 - 17
    assert tasks.carry_into(1, [9, 9, 9, 9]) == 3  # 36


def test_describe_is_json_and_names_the_split():
    described = tasks.DEFAULT_SPEC.describe("interpolation", seed=11)
    assert json.loads(json.dumps(described)) == described
    assert described["name"] == "arithmetic" and described["split"] == "interpolation"
    assert described["counts"] == [5] and described["seed"] == 11
    assert described["max_length"] == tasks.DEFAULT_SPEC.max_length("interpolation")


def test_max_length_is_reached_by_the_longest_example():
    spec = tasks.TaskSpec(train_counts=(1, 3), interpolation_counts=(2,),
                          extrapolation_counts=(4,), digit_lengths=(1,))
    # longest train example: [N9-N9-N9=N27] -> 1 + 3*2 + 2 + 1 + 3 + 1
    assert spec.max_length("train") == 14
    batch = tasks.generate("train", 2000, seed=0, spec=spec)
    assert batch.tokens.shape[1] == 14 and batch.valid.sum(axis=1).max() == 14


@pytest.mark.parametrize("values, message", [
    ({"train_counts": [2, 4], "interpolation_counts": [4]}, "overlap"),
    ({"train_counts": [2, 4], "interpolation_counts": [5], "extrapolation_counts": [6]},
     "strictly between"),
    ({"extrapolation_counts": [5]}, "exceed"),
    ({"digit_lengths": []}, "non-empty"),
    ({"digit_lengths": [0]}, "positive"),
    ({"digits": [1]}, "unknown task keys"),
])
def test_bad_task_specs_are_config_errors(values, message):
    with pytest.raises(ConfigError, match=message):
        tasks.TaskSpec.from_table(values, "task")


def test_bad_split_and_characters_are_config_errors():
    with pytest.raises(ConfigError, match="unknown split 'validation'"):
        tasks.generate("validation", 3, seed=0)
    with pytest.raises(ConfigError, match="outside the task's vocabulary"):
        tasks.token_ids("[1*2=2]")


PAPER = tasks.TaskSpec(digit_lengths=(2, 3))
"""The paper's exact task: numbers of L in {2, 3} digits, its number counts."""
M = tasks.MISSING


def labelled(values, negative, subtract) -> dict[str, list]:
    example = tasks.written_example(values, negative, subtract)
    return {"text": "".join(example.chars), "role": example.roles, "operand": example.operand,
            "place": example.digit_place, "value": example.digit_value, "carry": example.carry}


def test_the_papers_example_is_written_and_labelled_by_hand():
    example = labelled([453, 16, 17, 846], [False, False, False, True], [False, False, False, True])
    assert example["text"] == "[453+16+17-N846=1332]"
    assert example["operand"] == [M, 0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 3, 3, M, M, M, M, M, M]
    assert example["place"] == [M, 2, 1, 0, M, 1, 0, M, 1, 0, M, M, 2, 1, 0, M, 3, 2, 1, 0, M]
    assert example["value"] == [M, 4, 5, 3, M, 1, 6, M, 1, 7, M, M, 8, 4, 6, M, 1, 3, 3, 2, M]
    # units 3+6+7+6 = 22 carry 2 into the tens; tens 53+16+17+46 = 132 carry 1 into the hundreds;
    # 453+16+17+846 = 1332 carries 1 into the thousands
    assert example["carry"] == [M] * 16 + [1, 1, 2, 0, M]
    assert example["role"][10:12] == ["operator", "sign"] and example["role"][15] == "equals"


@pytest.mark.parametrize("values, negative, subtract, text, answer_carries", [
    ([52, 17], [False, False], [False, True], "[52-17=35]", [-1, 0]),          # 2 - 7: a borrow from the tens
    ([17, 52], [False, False], [False, True], "[17-52=N35]", [-1, 0]),         # written as 52 - 17
    ([305, 8, 127], [False, True, False], [False, True, True], "[305-N8-127=186]", [-1, 0, 0]),  # 05+08-27 < 0
    ([99, 1], [False, False], [False, False], "[99+1=100]", [1, 1, 0]),
    ([40, 40], [True, False], [False, False], "[N40+40=0]", [0]),
])
def test_borrows_and_carries_on_hand_written_examples(values, negative, subtract, text, answer_carries):
    example = labelled(values, negative, subtract)
    assert example["text"] == text
    answer = [i for i, role in enumerate(example["role"]) if role == "answer" and example["text"][i] != "N"]
    assert [example["carry"][i] for i in answer] == answer_carries
    assert [example["place"][i] for i in answer] == list(range(len(answer) - 1, -1, -1))
    others = [i for i in range(len(text)) if i not in answer]
    assert {example["carry"][i] for i in others} == {M}  # never -1: that is a borrow


def test_the_papers_task_draws_counts_and_lengths_uniformly_per_example():
    batch = tasks.generate("train", 3000, seed=11, spec=PAPER)
    counts, widest, exact = [], [], []
    for i in range(len(batch)):
        terms, answer = signed_operands(batch.text(i))
        assert sum(terms) == answer
        counts.append(len(terms))
        widest.append(max(len(str(abs(t))) for t in terms))
        exact += [len(str(abs(t))) for t in terms]
    share = {n: counts.count(n) / len(counts) for n in (3, 4, 6)}
    assert set(counts) == {3, 4, 6} and all(abs(value - 1 / 3) < 0.04 for value in share.values())
    # L is drawn once per example, from {2, 3} uniformly; each number is uniform on [0, 10**L),
    # so in an example of L = 3 the widest number almost always has 3 digits
    assert set(widest) <= {1, 2, 3} and abs(widest.count(3) / len(widest) - 0.5) < 0.04
    assert set(exact) == {1, 2, 3}
    # [, nine numbers of sign and three digits, eight operators, =, N8991, ]
    assert PAPER.max_length("extrapolation") == 1 + 9 * 4 + 8 + 1 + 5 + 1
    for split, expected in (("interpolation", {5}), ("extrapolation", {7, 8, 9})):
        part = tasks.generate(split, 200, seed=11, spec=PAPER)
        assert {len(signed_operands(part.text(i))[0]) for i in range(len(part))} == expected
