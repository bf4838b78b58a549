"""MkDocs hook: cross-link the API reference to the JAX and Equinox docs, when asked to.

mkdocstrings reads object inventories (`objects.inv`) to turn names such as `jax.Array` into
links. It fetches them over the network while building, and an inventory it cannot fetch is
an *error*, which fails a `strict` build. So the inventories are opt-in: the default build
needs no network, and

    EQPAR_DOCS_INVENTORIES=1 mkdocs build          # the JAX and Equinox inventories
    EQPAR_DOCS_INVENTORIES="URL URL" mkdocs build  # these inventories (e.g. file:// mirrors)

adds them. Anything else (unset, empty, `0`) leaves them out.
"""

import os
from typing import Any

from mkdocs.plugins import event_priority

SWITCH = "EQPAR_DOCS_INVENTORIES"
DEFAULT_INVENTORIES = (
    "https://docs.jax.dev/en/latest/objects.inv",
    "https://docs.kidger.site/equinox/objects.inv",
)


def requested_inventories(value: str | None) -> list[str]:
    """The inventory URLs asked for by the switch's value."""
    value = (value or "").strip()
    if value.lower() in {"", "0", "false", "no", "off"}:
        return []
    if value.lower() in {"1", "true", "yes", "on"}:
        return list(DEFAULT_INVENTORIES)
    return value.split()


# Runs before mkdocstrings' own on_config (priority 0), which starts the downloads.
@event_priority(100)
def on_config(config: Any) -> Any:
    urls = requested_inventories(os.environ.get(SWITCH))
    if urls:
        handlers = config.plugins["mkdocstrings"].config.handlers
        python = handlers.setdefault("python", {})
        python["inventories"] = [*python.get("inventories", []), *urls]
    return config
