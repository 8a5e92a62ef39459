"""Which records an audit captures: shell-style globs on module and op names
(``scan``'s and ``run``'s ``--module``/``--exclude-module``/``--op``/``--exclude-op``),
and the checks that name a glob that matches nothing."""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass

from fpaudit.errors import Named, OptionError, UsageError
from fpaudit.report.records import KIND_GRAD, LOSS_MODULE


@dataclass(frozen=True)
class Selection:
    """Which records to capture: shell-style globs on module and op names.

    ``modules`` and ``ops`` list what to keep (empty: everything); the
    ``exclude_`` lists win over them. Module patterns match qualified names
    (``blocks.*.attn``; ``blocks.0*`` for a subtree, ``<loss>`` for the loss
    pseudo-module); op patterns match aten op names as reported
    (``aten.mm.*``, ``*softmax*``) and do not apply to parameter gradients.
    Skipped records cost no histogram work.
    """

    modules: tuple[str, ...] = ()
    exclude_modules: tuple[str, ...] = ()
    ops: tuple[str, ...] = ()
    exclude_ops: tuple[str, ...] = ()

    @staticmethod
    def _matches(name: str, patterns: tuple[str, ...]) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)

    def accepts(self, kind: str, module: str, op: str) -> bool:
        if self.modules and not self._matches(module, self.modules):
            return False
        if self._matches(module, self.exclude_modules):
            return False
        if kind == KIND_GRAD:
            return True
        if self.ops and not self._matches(op, self.ops):
            return False
        return not self._matches(op, self.exclude_ops)

    def describe(self) -> dict[str, list[str]]:
        return {k: list(v) for k, v in self.__dict__.items() if v}

    def check_modules(self, names: Iterable[str]) -> None:
        """Raise ``UsageError`` naming a module glob that matches none of ``names`` (the
        model's modules; ``<loss>`` is always one), with the closest names, or when the
        globs together keep no module at all."""
        known = list(dict.fromkeys([LOSS_MODULE, *names]))
        for field in ("modules", "exclude_modules"):
            for pattern in getattr(self, field):
                if not any(fnmatch.fnmatchcase(name, pattern) for name in known):
                    raise _no_match(field, pattern, known, "module")
        if not any(self.accepts(KIND_GRAD, name, "") for name in known):
            raise UsageError(
                "the selection ",
                *self._globs("modules", "exclude_modules"),
                " leaves no module of the model to measure",
            )

    def check_ops(self, ops: Iterable[str]) -> None:
        """Raise ``UsageError`` naming an op glob that matches none of ``ops`` (the aten
        ops that ran in backward), with the closest names, or when the globs keep none."""
        seen = sorted(set(ops))
        if not seen:
            return  # nothing ran in backward: the report says it measured nothing
        for field in ("ops", "exclude_ops"):
            for pattern in getattr(self, field):
                if not any(fnmatch.fnmatchcase(op, pattern) for op in seen):
                    raise _no_match(field, pattern, seen, "backward op")
        kept = [
            op
            for op in seen
            if (not self.ops or self._matches(op, self.ops))
            and not self._matches(op, self.exclude_ops)
        ]
        if (self.ops or self.exclude_ops) and not kept:
            raise UsageError(
                "the selection ",
                *self._globs("ops", "exclude_ops"),
                " leaves no backward op of the model to measure",
            )

    def _globs(self, *fields: str) -> list[str | Named]:
        """The globs of ``fields`` as a message names them, one parameter after another
        (``modules=('a',) exclude_modules=('*',)``; ``--module a --exclude-module '*'``)."""
        parts: list[str | Named] = [
            part
            for field in fields
            if getattr(self, field)
            for part in (" ", Named(field, getattr(self, field)))
        ]
        return parts[1:]


def _no_match(field: str, pattern: str, names: list[str], what: str) -> OptionError:
    shown = [n if n else "(root)" for n in names]
    close = difflib.get_close_matches(pattern, shown, n=3, cutoff=0.5)
    if close:
        hint = f"closest: {', '.join(close)}"
    else:
        listed = ", ".join(shown[:8]) + (", ..." if len(shown) > 8 else "")
        hint = f"{what}s are: {listed}"
    return OptionError(field, f"{pattern!r} matches no {what} of the model ({hint})")
