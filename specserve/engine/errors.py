"""The engine's exception types. A leaf module (no torch, no engine imports), so the API, the worker and
every engine stage can raise and catch them without importing one another."""

from __future__ import annotations


class InvalidParameter(ValueError):
    """A request field is wrong; `field` names it so an API can answer 4xx with the culprit."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message
