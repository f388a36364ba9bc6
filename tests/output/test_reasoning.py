import pytest

from qbatch.output.reasoning import split_reasoning


@pytest.mark.parametrize(
    ("output", "thinking", "expected"),
    [
        ("<think>\nplan it\n</think>\n\nThe answer.", True, ("plan it", "The answer.")),
        ("plan it</think>The answer.", True, ("plan it", "The answer.")),
        ("a</think>b</think>final", True, ("a</think>b", "final")),  # split at the last </think>
        ("<think>still thinking, cut off", True, ("still thinking, cut off", "")),
        ("Just an answer.", False, (None, "Just an answer.")),
        ("<think>\n\n</think>\n\nAnswer", False, (None, "Answer")),
        ("Plain model text </think> kept", None, (None, "Plain model text </think> kept")),
    ],
)
def test_split(output, thinking, expected):
    assert split_reasoning(output, thinking) == expected
