"""Rewards for tests: dense enough that an untrained tiny model gets varied scores within a group."""


def digit_fraction(response: str, sample: dict) -> float:
    """Fraction of the response's characters that are digits."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)


def text_hash(response: str, sample: dict) -> float:
    """A deterministic score in [0, 1) that differs between any two different responses (CRC32 of the text):
    every group of distinct samples gets nonzero advantages, whatever the (untrained) model writes. For
    plumbing tests that need a gradient at every step; it means nothing to learn."""
    import zlib
    return zlib.crc32(response.encode()) / 2 ** 32


def add_reward(response: str, sample: dict) -> float:
    """data_sources drill: in [1, 1.1) for samples of source `add`; raises on any other (the trajectory fails)."""
    if sample.get("source") != "add":
        raise ValueError(f"add_reward got a sample of source {sample.get('source')!r}")
    return 1.0 + text_hash(response, sample) / 10


def sub_reward(response: str, sample: dict) -> float:
    """data_sources drill: in (-1.1, -1] for samples of source `sub`; raises on any other."""
    if sample.get("source") != "sub":
        raise ValueError(f"sub_reward got a sample of source {sample.get('source')!r}")
    return -1.0 - text_hash(response, sample) / 10


def verdict_hash(verdict: str) -> float:
    """A judge `parse` for tests: CRC32 of the judge's whole verdict text in [0, 1), so a reward equals it only if
    the verdict is exactly the text expected."""
    import zlib
    return zlib.crc32(verdict.encode()) / 2 ** 32


def program_reward(response: str, sample: dict) -> float:
    """The reward a black-box program computed itself and printed as its last line, {"reward": x, ...}
    (tests/verifiers_agents.py: a verifiers environment's rubric)."""
    import json
    return float(json.loads(response.strip().splitlines()[-1])["reward"])
