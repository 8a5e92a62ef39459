"""FP8 delayed scaling's policies, declared once: a registry of their own kind.

A delayed-scaling policy keeps a scale per tensor from that tensor's amax history
(Transformer Engine's ``DelayedScaling``, MS-AMP's power-of-two variant); it is not a
loss scaler, and :mod:`fpaudit.rules.delayed` replays it. ``simulate --policy`` takes
these names beside the loss scalers' (:data:`fpaudit.rules.scalers.REGISTRY`). Kept in a
module of its own, without numpy or pandas, so that the command line can list the
names without loading the replay.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DelayedPolicy:
    """One FP8 delayed-scaling policy: its name and whether its scale is rounded to a
    power of two (MS-AMP) or kept as the quotient of the format's max and the amax
    (Transformer Engine). Adding one is an entry in ``REGISTRY`` and its branch in
    :func:`fpaudit.rules.delayed.scale_update`."""

    name: str
    power_of_two: bool


REGISTRY: dict[str, DelayedPolicy] = {
    policy.name: policy
    for policy in (
        DelayedPolicy("te-delayed", power_of_two=False),
        DelayedPolicy("msamp-delayed", power_of_two=True),
    )
}
POLICIES: tuple[str, ...] = tuple(REGISTRY)
