import threading

import pytest

from strop.rollout.rewards import exact_match_reward, extract_answer, math_equal, math_reward, reasoning_gym_reward
from strop.types import Sample


@pytest.mark.parametrize(
    "response,gold,ok",
    [
        ("So 4 - 1 - 7 = -4", "-4", True),
        ("The answer is \\boxed{\\frac{1}{2}}.", "0.5", True),
        ("\\boxed{0.5} but earlier I said 3", "1/2", True),  # the box wins over later numbers
        ("Total: 1,234.", "1234", True),  # thousands separator
        ("It is 3, no wait, 5", "3", False),  # the last number counts
        ("\\boxed{x^2 + 2x}", "2x + x^2", True),  # algebraic equality
        ("no number here", "4", False),
        ("7.0", "7", True),
        ("\\boxed{\\frac{1}{3}}", "0.33", False),
    ],
)
def test_math_equal_on_tricky_answers(response, gold, ok):
    assert math_equal(response, gold) is ok


def test_math_reward_is_safe_outside_the_main_thread():
    out = []
    s = Sample(prompt="q", prompt_ids=[1], label="-4", response_text="= -4")
    t = threading.Thread(target=lambda: out.append(math_reward(s)))
    t.start()
    t.join(30)
    assert out == [1.0]


def test_exact_match_and_extraction():
    assert extract_answer("a \\boxed{{1}+2} b") == "{1}+2"
    s = Sample(prompt="q", prompt_ids=[1], label="12", response_text="the result is 12.")
    assert exact_match_reward(s) == 1.0
    s.label = "12.0"
    assert exact_match_reward(s) == 0.0  # exact, not mathematical


def test_reasoning_gym_scorer():
    import reasoning_gym

    entry = reasoning_gym.create_dataset("chain_sum", seed=3, size=1)[0]
    meta = {"reasoning_gym_task": "chain_sum", "reasoning_gym_entry": entry}
    good = Sample(
        prompt="q", prompt_ids=[1], label=entry["answer"], metadata=meta, response_text=f"It is {entry['answer']}"
    )
    bad = Sample(prompt="q", prompt_ids=[1], label=entry["answer"], metadata=meta, response_text="It is 100000")
    assert reasoning_gym_reward(good) == 1.0 and reasoning_gym_reward(bad) == 0.0
    with pytest.raises(ValueError, match="reasoning_gym_entry"):
        reasoning_gym_reward(Sample(prompt="q", prompt_ids=[1]))
