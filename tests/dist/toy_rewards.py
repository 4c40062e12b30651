"""A reward that varies with the response, so a tiny random model gets non-zero advantages."""


def distinct_chars(response: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """Number of distinct characters of the response, scaled to about [0, 1]."""
    return len(set(response)) / 10.0
