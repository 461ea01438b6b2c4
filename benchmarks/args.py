"""argparse types shared by the commands: a bad value becomes argparse's one-line error naming
the flag, instead of a traceback deep in the run (``--seq-lens 0`` was a ZeroDivisionError)."""
import argparse


def number(kind, low, low_ok=True, high=None):
    """A ``type=`` parsing ``kind`` (int or float) with ``low <= x`` (``low < x`` when not
    ``low_ok``) and ``x < high``."""
    name = "an integer" if kind is int else "a number"
    bound = (f">= {low}" if low_ok else f"> {low}") + (f" and < {high}" if high else "")

    def parse(text):
        try:
            x = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {name} {bound}, got {text!r}") from None
        if x != x or (x < low if low_ok else x <= low) or (high is not None and x >= high):
            raise argparse.ArgumentTypeError(f"expected {name} {bound}, got {text!r}")
        return x
    parse.__name__ = kind.__name__  # what argparse names in its own messages
    return parse


def dims(example):
    """A ``type=`` parsing positive integers joined by ``x``, as many as ``example`` has."""
    n = len(example.split("x"))

    def parse(text):
        parts = text.lower().split("x")
        if len(parts) != n or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(f"expected {n} positive integers joined by x, "
                                             f"e.g. {example}; got {text!r}")
        return tuple(int(p) for p in parts)
    return parse


POSITIVE_INT = number(int, 1)
COUNT = number(int, 0)             # 0 has a meaning (none / PyTorch's default / no limit)
POSITIVE_FLOAT = number(float, 0.0, low_ok=False)
SECONDS = number(float, 0.0)
PROBABILITY = number(float, 0.0, high=1.0)
