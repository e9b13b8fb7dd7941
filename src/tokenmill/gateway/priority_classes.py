"""Priority classes by name, as the keys file and the gateway headers spell them (0 goes
first). Their own module because the router reads them and imports nothing of the engine."""
from __future__ import annotations

PRIORITY_CLASSES = {"critical": 0, "high": 1, "normal": 2, "standard": 2, "low": 3, "batch": 4, "sheddable": 4}


def parse_priority_class(value: str | int | None) -> int:
    """A class name (``PRIORITY_CLASSES``) or a non-negative integer; None: normal."""
    if value is None:
        return PRIORITY_CLASSES["normal"]
    if isinstance(value, bool):
        raise ValueError(f"priority class must be a name or an integer, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"priority class must be non-negative, got {value}")
        return value
    text = str(value).strip().lower()
    if text.isdigit():
        return int(text)
    if text not in PRIORITY_CLASSES:
        raise ValueError(f"unknown priority class {value!r}; use one of {', '.join(PRIORITY_CLASSES)} "
                         "or an integer (0 first)")
    return PRIORITY_CLASSES[text]
