"""The warm pool's board (tests/warm.py): a Ray actor holding, by warm actor, the constructor
arguments of the worker last built in it. Its own module, importing nothing heavy: the actor's
process imports only this (tests/warm.py would pull torch and the engine, ~2 s of CPU, into a process
that stores a few references)."""

from __future__ import annotations


class ArgsBoard:
    """By warm actor, the constructor arguments of the worker last built in it (a one-element list
    holding the driver's ObjectRef of ``(args, kwargs)``: never unpickled here)."""

    def __init__(self):
        self.posted: dict[str, list] = {}

    def put(self, key: str, boxed: list) -> None:
        self.posted[key] = boxed

    def get(self, key: str) -> list:
        return self.posted[key]

    def drop(self, keys: list[str]) -> None:
        for key in keys:
            self.posted.pop(key, None)
