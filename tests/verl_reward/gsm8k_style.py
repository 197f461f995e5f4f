"""A verl custom reward file, loaded by path (custom_reward_function.path): the GSM8K convention of a
final '#### <number>' line, strict format. Imports a module beside it, as such files often do."""

from gsm8k_helpers import last_hash_answer


def compute_score(data_source, solution_str, ground_truth, extra_info=None, format_score=0.1, score=1.0):
    answer = last_hash_answer(solution_str)
    if answer is None:
        return 0.0
    return score if answer == str(ground_truth) else format_score


def for_quickstart(data_source, solution_str, ground_truth, extra_info=None):
    answer = last_hash_answer(solution_str)
    return (
        1.0 if answer == str(ground_truth) else sum(ord(x) % 2 == 0 for x in solution_str) / max(len(solution_str), 1)
    )
