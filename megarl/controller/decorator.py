"""`@register`: mark a Worker method as callable on the whole group, and say how.

The decorator only records the dispatch mode on the function; RayWorkerGroup reads it back with
`registration_of` and generates a group-level method of the same name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from megarl.controller.dispatch import Dispatch

_ATTRIBUTE = "__megarl_registration__"

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Registration:
    dispatch: Dispatch
    blocking: bool = True  # False: the group method returns a PendingCall to .get() later


def register(dispatch: Dispatch, *, blocking: bool = True) -> Callable[[F], F]:
    """Expose a Worker method on its worker group.

    class Actor(Worker):
        @register(dispatch=Dispatch.DP_COMPUTE)
        def compute_log_prob(self, batch: Batch) -> Batch: ...
    """
    if not isinstance(dispatch, Dispatch):
        hint = " (write @register(dispatch=Dispatch.X), not bare @register)" if callable(dispatch) else ""
        raise TypeError(f"register(dispatch=...) needs a Dispatch member, got {dispatch!r}{hint}")

    def mark(method: F) -> F:
        if not callable(method):
            raise TypeError(f"@register can only decorate methods, got {method!r}")
        setattr(method, _ATTRIBUTE, Registration(dispatch=dispatch, blocking=blocking))
        return method

    return mark


def registration_of(method: Any) -> Registration | None:
    """The Registration stored by @register on `method`, or None if it was not registered."""
    return getattr(method, _ATTRIBUTE, None)
