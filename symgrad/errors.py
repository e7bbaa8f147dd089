"""The one error type every stage raises for bad input.

A `SymgradError` is always the user's problem, never a bug: the CLI prints it as one
line (plus a caret line under the formula when there is a position) and exits with 2.
"""

from __future__ import annotations

WINDOW = 80  # at most this much of a long formula is shown around the caret


class SymgradError(Exception):
    """Bad input, explained.

    `where` names the place (spec file and op), `formula`/`column` point into a formula
    so the message can show a caret under the offending character.
    """

    def __init__(
        self,
        message: str,
        *,
        where: str = "",
        formula: str | None = None,
        column: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.where = where
        self.formula = formula
        self.column = column

    def located(self, where: str, formula: str | None = None) -> SymgradError:
        """The same error with a place prepended (innermost place last)."""
        place = f"{where}: {self.where}" if self.where else where
        return SymgradError(
            self.message,
            where=place,
            formula=self.formula if self.formula is not None else formula,
            column=self.column,
        )

    def render(self) -> str:
        """One line, plus the formula and a caret when a column is known."""
        where, message = _visible(self.where), _visible(self.message)
        head = f"error: {where}: {message}" if where else f"error: {message}"
        if self.formula is None or self.column is None:
            return head
        formula = "".join(char if " " <= char <= "~" else "?" for char in self.formula)
        column = min(max(self.column, 0), len(formula))
        if len(formula) > WINDOW + 20:  # a long formula: show the part around the caret
            start = max(0, min(column - WINDOW // 2, len(formula) - WINDOW))
            end = start + WINDOW
            before = "..." if start > 0 else ""
            after = "..." if end < len(formula) else ""
            formula = before + formula[start:end] + after
            column = column - start + len(before)
        return f"{head}\n    {formula}\n    {' ' * column}^"

    def __str__(self) -> str:
        return self.render()


def _visible(text: str) -> str:
    """Control and invisible characters (newlines, U+202E...) escaped: one honest line."""
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else f"\\u{ord(char):04x}" for char in text)


def counted(n: int, noun: str, plural: str = "") -> str:
    """`n noun` with the noun in the plural unless n is 1: "1 op", "3 ops", "1 index"."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
