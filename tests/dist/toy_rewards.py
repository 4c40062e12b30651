"""A reward that varies with the response, so a tiny random model gets non-zero advantages."""


def distinct_chars(response: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """Number of distinct characters of the response, scaled to about [0, 1]."""
    return len(set(response)) / 10.0


def odd_length(response: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """1 for a response of odd character length, else 0: the two responses of a group often tie,
    so DAPO's dynamic sampling has groups to drop and refill."""
    return float(len(response) % 2)


def fails_on_rank_1(response: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """Raises in the worker of rank 1 only (rank 0 goes on into the next collective)."""
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise RuntimeError("reward failed on rank 1")
    return 0.0


_calls = {"n": 0}


def fails_in_step_2(response: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """Scores like ``distinct_chars`` for the first 4 calls of a process (step 1 of a 2-worker,
    4 prompts x 2 samples job), then raises: a user's bug that only some responses reach."""
    _calls["n"] += 1
    if _calls["n"] > 4:
        raise KeyError("answer")
    return len(set(response)) / 10.0
