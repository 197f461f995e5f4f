def score_a(solution_str, ground_truth):
    return 1.0


def score_b(solution_str, ground_truth):
    return 0.0
