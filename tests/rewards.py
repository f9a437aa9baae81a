"""Rewards for tests: dense enough that an untrained tiny model gets varied scores within a group."""


def digit_fraction(response: str, sample: dict) -> float:
    """Fraction of the response's characters that are digits."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)
