"""A user's tool, named in params by its import path (tests.stages.tools.user_tools.mul)."""


def mul(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a * b
