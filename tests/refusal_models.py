"""Importable classes and functions for tests/test_refusal_advice.py: a refusal can only suggest ``allow=``
entries for objects a module defines (a class defined in a test function is pickled by value)."""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Any

import torch
from torch import nn


class Config:
    def __init__(self, steps: int) -> None:
        self.steps = steps


@dataclasses.dataclass
class Point:
    x: float
    y: float


class Color(enum.Enum):
    RED = 1
    BLUE = 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.act = nn.GELU()
        self.scale = Config(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.linear(x)) * self.scale.steps


class Interned:
    """A class whose ``__new__`` may hand back a shared object: what it makes must never be filled."""

    shared: Interned | None = None

    def __new__(cls) -> Interned:
        if cls.shared is None:
            cls.shared = super().__new__(cls)
        return cls.shared

    def __reduce__(self) -> Any:
        return (Interned, (), {"value": 1})


def make_pair(a: int, b: int) -> tuple[int, int]:
    """A rebuild function a reducer names (it checks its arguments, as allow_function asks)."""
    if type(a) is not int or type(b) is not int:
        raise TypeError("make_pair takes two ints")
    return (a, b)


class Paired:
    """Reduced to a call of :func:`make_pair`: its stream *calls* a function outside the safe set."""

    def __init__(self, a: int, b: int) -> None:
        self.a, self.b = a, b

    def __reduce__(self) -> Any:
        return (make_pair, (self.a, self.b))


def scale(x: float, factor: float = 2.0) -> float:
    return x * factor


PARTIAL = functools.partial(scale, factor=3.0)
