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
