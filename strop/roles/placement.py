"""Where a role of the run works, declared once on its class (``placement = ...``).

Every rank runs the same driver (strop.loop) top to bottom; a role is one job of the run (rollout, the
train step, engine sync, outputs, checkpoints, evaluation). Its class says on which ranks it works:

- ``EVERY_RANK``: every rank calls it (the train step, each rank's checkpoint shard);
- ``RANK0``: rank 0 (the controller) only; the other ranks wait for it and get None, or its failure;
- ``CONTROL``: rank 0 only, and every rank gets its result, or its failure, through the control
  channel (strop.parallel.runtime.Control): rank 0 generates the step's samples, every rank trains on them.

:class:`Placed` is a role as every rank sees it: a method call goes where the class says. A parameter
named ``weights`` of a rank-0 method is served by the other ranks while rank 0 reads it (sharded
weights are gathered a bucket at a time, strop.parallel.gather).
"""

from __future__ import annotations

import functools
import inspect

from strop.parallel.runtime import Control

EVERY_RANK, RANK0, CONTROL = "every rank", "rank 0 only", "the control channel"


class Placed:
    """``role`` (the instance on the ranks it works on, None on the others) of class ``cls``, called
    where ``cls.placement`` says. ``here`` is the instance itself: what this rank alone may call (a
    failure's summary, the shutdown), with no other rank taking part."""

    def __init__(self, control: Control, cls: type, role):
        if cls.placement not in (EVERY_RANK, RANK0, CONTROL):
            raise TypeError(f"{cls.__qualname__}.placement={cls.placement!r}: one of strop.roles.placement's")
        self.control, self.cls, self.here = control, cls, role

    def __getattr__(self, name: str):
        if self.cls.placement == EVERY_RANK:
            return getattr(self.here, name)
        method = getattr(self.cls, name)
        signature = inspect.signature(method)
        share = self.cls.placement == CONTROL

        @functools.wraps(method)
        def on_rank0(*args, **kwargs):
            weights = signature.bind(self.here, *args, **kwargs).arguments.get("weights")
            return self.control.on_controller(
                functools.partial(method, self.here, *args, **kwargs), share=share, serving=weights
            )

        return on_rank0
