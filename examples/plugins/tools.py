"""Tools hooks: your own tools for multi-turn rollouts, next to the built-in python and calculator.

    strop train --plugins.tools=examples.plugins.tools:number_theory_tools

A tool is a function that takes its JSON schema's properties as keywords and returns text.
An exception becomes "Error: ..." for the model to read; it does not fail the sample.
"""

import math

from strop.tools import Tool


def factorize(n: int) -> str:
    n = int(n)
    if not 2 <= n <= 10**12:
        raise ValueError(f"n must be an integer from 2 to 10**12, got {n}")
    factors, p = [], 2
    while p * p <= n:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    if n > 1:
        factors.append(n)
    return " * ".join(map(str, factors))


def gcd(a: int, b: int) -> str:
    return str(math.gcd(int(a), int(b)))


def number_theory_tools(config) -> list[Tool]:
    """Prime factorisation and greatest common divisor (``config`` is the tools section; unused here)."""
    integer = {"type": "integer"}
    return [
        Tool(
            "factorize",
            "Prime factors of an integer n (2 <= n <= 10**12), e.g. '2 * 2 * 3' for 12.",
            {"type": "object", "properties": {"n": integer}, "required": ["n"]},
            factorize,
        ),
        Tool(
            "gcd",
            "Greatest common divisor of two integers.",
            {"type": "object", "properties": {"a": integer, "b": integer}, "required": ["a", "b"]},
            gcd,
        ),
    ]
