"""`llama-sidecar probe URL`: N concurrent streams, every SSE line timestamped, a summary."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated
from urllib.parse import urlsplit

import typer

from sidecar.ops.probe import (
    DEFAULT_PATH,
    INTERRUPTED,
    NATIVE_PATH,
    ProbeOptions,
    endpoint_url,
    has_chat_template,
    plot,
    run_probe,
    summarize,
    table,
    to_json,
)

NO_TEMPLATE = (
    "the served model has no chat template: on {chat} llama-server falls back to ChatML, "
    "which a model not trained on it answers with template markers"
)


def _check_template(url: str, api_key: str | None) -> str:
    """The URL to probe: /completion instead of the default chat endpoint when the model
    has no chat template (said on stderr either way)."""
    if not endpoint_url(url).endswith(DEFAULT_PATH) or has_chat_template(url, api_key) is not False:
        return url
    message = NO_TEMPLATE.format(chat=DEFAULT_PATH)
    if urlsplit(url if "://" in url else "http://" + url).path in ("", "/"):  # a bare URL
        native = url.rstrip("/") + NATIVE_PATH
        hint = f"give {DEFAULT_PATH} explicitly to probe the chat endpoint"
        typer.echo(f"probe: {message}; probing {native} instead ({hint})", err=True)
        return native
    typer.echo(f"probe: warning: {message}; probe {NATIVE_PATH} for plain text", err=True)
    return url


def probe(
    url: Annotated[
        str,
        typer.Argument(
            help="The sidecar (or llama-server) base URL, e.g. http://127.0.0.1:8081, or a full "
            "endpoint: /v1/chat/completions (the default), /v1/completions or /completion."
        ),
    ],
    streams: Annotated[
        int, typer.Option("--streams", "-n", min=1, help="Concurrent requests.")
    ] = 2,
    prompt: Annotated[
        str, typer.Option("--prompt", "-p", help="The prompt.")
    ] = "Write a long story about a lighthouse keeper.",
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", "-t", min=1, help="Tokens per stream.")
    ] = 160,
    ignore_eos: Annotated[
        bool, typer.Option(help="Ask for exactly --max-tokens tokens (llama-server's ignore_eos).")
    ] = True,
    stagger: Annotated[
        float, typer.Option(help="Seconds between the starts of the streams.")
    ] = 0.0,
    extra: Annotated[
        str | None,
        typer.Option(
            help="JSON object merged into every request body, e.g. '{\"temperature\": 0}'."
        ),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="LLAMA_SIDECAR_API_KEY", help="Bearer key, if the sidecar requires one."
        ),
    ] = None,
    timeout: Annotated[float, typer.Option(help="Read timeout per stream, in seconds.")] = 600.0,
    as_json: Annotated[
        bool,
        typer.Option("--json", help="Print one JSON document (lines, summaries, totals) instead."),
    ] = False,
    plot_file: Annotated[
        Path | None,
        typer.Option("--plot", help="Draw the timeline into this PNG (needs matplotlib)."),
    ] = None,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="Only the summary, no timeline.")
    ] = False,
    width: Annotated[
        int, typer.Option(help="Cut timeline lines to this many characters (0: never).")
    ] = 160,
) -> None:
    """Run N concurrent streaming requests; print every SSE line with its arrival time.

    A model without a chat template would answer the chat endpoint with template markers
    (llama-server's ChatML fallback): given a bare URL, probe then uses /completion and
    says so; given the chat endpoint explicitly, it warns and probes it anyway.

    Comment lines are shown too: `: preempted`, `: resumed`, `: recomputed`,
    `: preempt-keepalive` (the server parked the stream), `: keepalive` (the sidecar kept
    an idle stream alive) and `:` (a ping). The summary counts them per stream, with the
    longest silence the client saw and tokens per second. Exits 1 if a stream failed.
    """
    try:
        body_extra = json.loads(extra) if extra else {}
        if not isinstance(body_extra, dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        typer.echo(f"error: --extra must be a JSON object: {e}", err=True)
        raise typer.Exit(2) from None
    if plot_file is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            typer.echo("error: --plot needs matplotlib: pip install -e '.[plot]'", err=True)
            raise typer.Exit(2) from None
    url = _check_template(url, api_key)
    opts = ProbeOptions(
        url=url, streams=streams, prompt=prompt, max_tokens=max_tokens, ignore_eos=ignore_eos,
        stagger=stagger, timeout=timeout, api_key=api_key, extra=body_extra,
    )  # fmt: skip

    def on_line(stream: int, t: float, text: str) -> None:
        if width and len(text) > width:
            text = text[: width - 3] + "..."
        sys.stdout.write(f"{t:9.3f}s  #{stream:<3d} {text}\n")
        sys.stdout.flush()

    live = not (quiet or as_json)
    if live:
        typer.echo(f"probe: {streams} stream(s) -> {endpoint_url(url)}")
    records = run_probe(opts, on_line if live else None, handle_sigint=True)
    interrupted = any(r.error == INTERRUPTED for r in records)
    summaries = [summarize(r) for r in records]
    if as_json:
        typer.echo(json.dumps(to_json(opts, records, summaries), indent=1))
    else:
        if live:
            typer.echo("")
        typer.echo(table(summaries))
        for s in summaries:
            if s.error:
                typer.echo(f"#{s.index}: {s.error}", err=True)
    if plot_file is not None:
        plot(summaries, plot_file)
        if not as_json:
            typer.echo(f"plot: {plot_file}")
    if interrupted:
        raise typer.Exit(130)
    if any(s.outcome != "done" for s in summaries):
        raise typer.Exit(1)
