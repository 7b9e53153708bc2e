"""The table of options (:data:`sidecar.config.OPTIONS`) as command parameters.

:func:`with_table` gives a command one typer option per row: ``proxy`` every row,
``up`` every row but ``upstream`` (which is its own llama-server).  Each arrives as
text, from the flag or from its ``LLAMA_SIDECAR_*`` variable, and :func:`config_from`
parses it with the table, so both spell values the same way.  The docs' tables are
generated from the same rows (:mod:`sidecar.cli.tables`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Annotated, Any

import typer

from sidecar.config import OPTIONS, Config, environ_values

__all__ = ["config_from", "table_parameters", "with_table"]


def table_parameters(exclude: Iterable[str] = ()) -> list[inspect.Parameter]:
    """Keyword parameters for a typer command: one per row of the table."""
    skip = set(exclude)
    params = []
    for o in OPTIONS:
        if o.name in skip:
            continue
        shown = "off" if o.default is None else o.format(o.default) or '""'
        info = typer.Option(o.flag, envvar=o.env, help=o.help, metavar=o.metavar,
                            show_default=shown)  # fmt: skip
        params.append(inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=None,
                                        annotation=Annotated[str | None, info]))  # fmt: skip
    return params


def with_table(command: Callable[..., Any], exclude: Iterable[str] = ()) -> None:
    """Give ``command`` (whose table options arrive in ``**kwargs``) the table's parameters."""
    own = [
        p
        for p in inspect.signature(command, eval_str=True).parameters.values()
        if p.kind is not inspect.Parameter.VAR_KEYWORD
    ]
    sig = inspect.Signature([*own, *table_parameters(exclude)])
    command.__signature__ = sig  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in sig.parameters.values()}


def config_from(given: dict[str, str | None], **overrides: Any) -> Config:
    """The config of the flags given (text or None), over the variables, over the defaults.

    click ignores an empty variable; for an option that may be unset the table reads
    it as "unset" (``LLAMA_SIDECAR_METRICS_LISTEN=`` disables metrics), so the
    variables are read here, then the flags given beat them.
    """
    raw = environ_values()
    for name in overrides:
        raw.pop(name, None)
    raw.update((name, text) for name, text in given.items() if text is not None)
    try:
        return Config.from_text(raw, **overrides)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
