"""The one error type every stage raises for bad input.

A `SymgradError` is always the user's problem, never a bug: the CLI prints it as one
line (plus a caret line under the formula when there is a position) and exits with 2.
"""

from __future__ import annotations


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
        head = f"error: {self.where}: {self.message}" if self.where else f"error: {self.message}"
        if self.formula is None or self.column is None:
            return head
        return f"{head}\n    {self.formula}\n    {' ' * self.column}^"

    def __str__(self) -> str:
        return self.render()
