"""The ``mneme`` command line.

``mneme up`` runs every service in one process on the embedded stores; the other
commands are gRPC clients of a running server (``--address``, or ``MNEME_ADDRESS``; TLS
with ``--tls-ca``/``--tls-cert``/``--tls-key`` or ``MNEME_CLIENT_TLS_*``),
except ``replay``, which rebuilds the projections of a stopped server's data dir, and
``reembed``, which moves a stopped server's data dir to another embedding model.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import List, Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import grpc  # noqa: E402
import typer  # noqa: E402
from rich.console import Console as _RichConsole  # noqa: E402
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,  # noqa: E402
                           TimeElapsedColumn, TimeRemainingColumn)
from rich.table import Table as _RichTable  # noqa: E402

#: C0 and C1 control characters but tab and newline: stored text that holds them (an
#: ANSI escape sequence, a carriage return) would recolour, move or clear the terminal.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _visible(text: str) -> str:
    """``text`` with each control character shown as its ``\\xNN`` escape."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


class Console(_RichConsole):
    """A rich Console whose printed strings show control characters as escapes."""

    def print(self, *objects, **kwargs) -> None:  # noqa: A003
        super().print(*(_visible(o) if isinstance(o, str) else o for o in objects), **kwargs)


class Table(_RichTable):
    """A rich Table whose string cells show control characters as escapes."""

    def add_row(self, *cells, **kwargs) -> None:
        super().add_row(*(_visible(c) if isinstance(c, str) else c for c in cells), **kwargs)


# Text from users and servers is data, never console markup. A command's result goes to
# stdout (so `$(mneme … delete …)` captures it); errors, hints and progress to stderr.
console = Console(stderr=True, markup=False, emoji=False, highlight=False, soft_wrap=True)
results = Console(markup=False, emoji=False, highlight=False, soft_wrap=True)


def _out() -> Console:
    """The console a command prints its tables to: stdout, as wide as the terminal, or
    200 columns when stdout is not one (a pipe or a file, unless COLUMNS says otherwise),
    so piped tables keep whole ids and words."""
    wide = sys.stdout.isatty() or os.environ.get("COLUMNS")
    return Console(markup=False, emoji=False, highlight=False, width=None if wide else 200)


#: The range of a proto int32 field: a CLI option filling one is bounded by it, so a
#: larger value is a usage error rather than the protobuf library's ValueError.
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def _configuration_errors() -> tuple[type[BaseException], ...]:
    """The errors that mean "the configuration cannot work" rather than a bug: a MNEME_*
    value of the wrong type (pydantic's ValidationError), a JSON setting that is not JSON
    (pydantic-settings' SettingsError) and every
    :class:`mneme.errors.ConfigurationError` (Kafka TLS/SASL settings that cannot work,
    files that cannot be read, topics that would lose records). Imported lazily: most
    commands never see one."""
    from pydantic import ValidationError
    from pydantic_settings import SettingsError
    from mneme.errors import ConfigurationError
    return ValidationError, SettingsError, ConfigurationError


def configuration_message(e: BaseException) -> str:
    """One line for configuration error ``e`` (:func:`mneme.config.configuration_message`)."""
    from mneme.config import configuration_message as message
    return message(e)


class _Commands(typer.core.TyperGroup):
    """The root command group. Every command runs inside its :meth:`invoke`, so this is
    the one place where an error a command did not handle becomes exit status 1 with one
    line on stderr instead of a traceback: a configuration error (see
    :func:`_configuration_errors`) for every command that reads the settings or opens
    the event log, a gRPC error as :func:`_fail` prints it (exit 2), and anything else as
    its type and message (``MNEME_DEBUG=1``: the traceback)."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except BrokenPipeError:
            # the reader went away (`| head`): click ends quietly (exit 1), as it does for a
            # pipe closed after the command
            raise
        except Exception as e:
            if type(e).__module__.split(".")[0] in ("click", "typer"):
                raise  # usage errors, exits and aborts: the command line library's own
            if isinstance(e, _configuration_errors()):
                console.print(f"configuration error: {configuration_message(e)}", style="red")
                raise typer.Exit(1)
            if isinstance(e, grpc.RpcError) and hasattr(e, "code"):
                _fail(e)
            # Anything else a command did not expect (a file it cannot read, a date it
            # cannot represent, a port in use) is one line on stderr, not a traceback;
            # MNEME_DEBUG=1 shows the traceback.
            if os.environ.get("MNEME_DEBUG"):
                raise
            console.print(f"error: {type(e).__name__}: {e}", style="red")
            raise typer.Exit(1)


app = typer.Typer(cls=_Commands, add_completion=False, no_args_is_help=True, rich_markup_mode="markdown",
                  help="mneme: long-term memory for AI agents.")
ADDRESS = os.environ.get("MNEME_ADDRESS", "127.0.0.1:50051")
AddressOpt = typer.Option(ADDRESS, "--address", "-a", help="gRPC address of a running server")


@app.callback()
def _options(ctx: typer.Context, api_key: Optional[str] = typer.Option(
        None, "--api-key", envvar="MNEME_API_KEY",
        help="API key sent to the server (MNEME_AUTH_MODE=api_key)"),
        tls_ca: Optional[str] = typer.Option(
            None, "--tls-ca", envvar="MNEME_CLIENT_TLS_CA",
            help="TLS to the server: CA (PEM) that signs its certificate"),
        tls_cert: Optional[str] = typer.Option(
            None, "--tls-cert", envvar="MNEME_CLIENT_TLS_CERT",
            help="client certificate (PEM) for an mtls server"),
        tls_key: Optional[str] = typer.Option(
            None, "--tls-key", envvar="MNEME_CLIENT_TLS_KEY",
            help="private key (PEM) of --tls-cert"),
        tls_server_name: Optional[str] = typer.Option(
            None, "--tls-server-name", envvar="MNEME_CLIENT_TLS_SERVER_NAME",
            help="name expected in the server's certificate")) -> None:
    # The client commands' MnemeClient reads these from the environment.
    for var, value in (("MNEME_API_KEY", api_key), ("MNEME_CLIENT_TLS_CA", tls_ca),
                       ("MNEME_CLIENT_TLS_CERT", tls_cert), ("MNEME_CLIENT_TLS_KEY", tls_key),
                       ("MNEME_CLIENT_TLS_SERVER_NAME", tls_server_name)):
        if value:
            os.environ[var] = value
    if ctx.invoked_subcommand not in ("up", "serve"):  # the servers refuse them outright
        from mneme.config import unknown_variables
        for name, hint in unknown_variables(os.environ):
            console.print(f"warning: {name} is not a mneme setting, ignored"
                          + (f" (did you mean {hint}?)" if hint else ""), style="yellow")


def _client(address: str):
    from mneme.client import MnemeClient
    return MnemeClient(address)


@contextlib.contextmanager
def _session(address: str):
    """The SDK client of ``address`` for one command; an RPC error raised in the block
    ends the command (exit 2, its status and field violations printed: :func:`_fail`)."""
    with _client(address) as m:
        try:
            yield m
        except grpc.RpcError as e:
            _fail(e)


def _fail(e: grpc.RpcError) -> None:
    from mneme.client import field_violations
    details = e.details() or ""
    console.print(f"{e.code().name}: {details}", style="red")
    for f, d in field_violations(e):
        if f"{f}: {d}" not in details:  # the message already names most of them
            console.print(f"  {f}: {d}")
    raise typer.Exit(2)


def _choice(option: str, value: str, allowed) -> str:
    """``value`` if it is one of ``allowed``, else a usage error naming the allowed values
    (exit 2) instead of a traceback."""
    if value not in allowed:
        console.print(f"invalid {option} {value!r}: one of {', '.join(allowed)}", style="red")
        raise typer.Exit(2)
    return value


_ZONE_HELP = ("the asker's zone, whose calendar 'yesterday' is read in: an IANA name "
              "(Europe/Paris) or an offset (+05:30); default: the --at's offset, else UTC")


def _aware(ts: Optional[datetime], zone: Optional[str] = None) -> Optional[datetime]:
    """``ts`` made aware: a time without an offset is read on the clock of ``zone`` (the
    --time-zone given with it) when that is a zone the server knows, else as UTC."""
    if ts is None or ts.tzinfo is not None:
        return ts
    from mneme.timeparse import time_zone
    try:
        return ts.replace(tzinfo=time_zone(zone or ""))
    except ValueError:  # the server refuses the zone, naming the field
        return ts.replace(tzinfo=timezone.utc)


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TimeRemainingColumn(), console=console)


@app.command()
def up(data_dir: Path = typer.Option(None, "--data-dir", "-d", help="default: $MNEME_DATA_DIR or ./.mneme"),
       address: str = typer.Option(None, "--address", "-a", help="listen address, default 127.0.0.1:50051")):
    """Serve every API (ingest, search, reflect, health, reflection) on one port, with
    every service running in this process on the embedded stores."""
    from mneme.datadir import DataDirLocked
    from mneme.runtime import allocator
    from mneme.runtime.embedded import bootstrap
    from mneme.config import Settings, check_environment

    check_environment()  # a misspelled or out-of-range setting stops the start, named
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    allocator.tune()
    overrides = {}
    if data_dir:
        overrides["data_dir"] = data_dir
    if address:
        overrides["grpc_address"] = address
    settings = Settings(**overrides)
    allocator.trim_every(settings.malloc_trim_interval_s)
    from mneme.runtime.grpc_server import setup_telemetry
    from mneme.bus.sqlite_log import LogDamaged
    try:
        node = bootstrap(settings)
    except (DataDirLocked, LogDamaged) as e:
        console.print(f"{e}", style="red")
        raise typer.Exit(1)
    from mneme.runtime import signals
    # before the consumers start and the port opens: a SIGTERM from then on drains
    stop = signals.stop_on_signals()
    tele = setup_telemetry("mneme", settings)
    node.start()
    port = node.serve()
    host = settings.grpc_address.rsplit(":", 1)[0]
    security = {"open": "no authentication (MNEME_AUTH_MODE=open): loopback use only",
                "api_key": "API keys required (MNEME_AUTH_MODE=api_key)",
                "mtls": "client certificates required (MNEME_AUTH_MODE=mtls)"}
    metrics = (f"; metrics on port {tele['metrics_port']}" if tele["metrics_port"] else "")
    console.print(f"mneme is up on {host}:{port} (data in {settings.data_dir.resolve()}); "
                  f"{security.get(settings.auth_mode, settings.auth_mode)}{metrics}. "
                  "Ctrl-C stops it.")
    signals.wait(stop)
    console.print("stopping: draining consumers …")
    node.close()


@app.command()
def serve(service: str = typer.Argument(..., help="ingest | extraction | search | reflect | "
                                                  "consolidation"),
          data_dir: Path = typer.Option(None, "--data-dir", "-d",
                                        help="local state of this service; default "
                                             "$MNEME_DATA_DIR or ./.mneme"),
          address: str = typer.Option(None, "--address", "-a",
                                      help="gRPC listen address (health on every service)")):
    """Run one service as its own process (distributed topology), configured by MNEME_*
    variables: MNEME_BUS_URL=kafka://host:9092, the store URLs, MNEME_SEARCH_ADDRESS
    (reflect). SIGTERM drains, commits and closes."""
    from mneme.bootstrap import SERVICES
    from mneme.runtime.process import run_service
    from mneme.config import Settings, check_environment

    if service not in SERVICES:
        console.print(f"unknown service {service!r}; one of {', '.join(SERVICES)}", style="red")
        raise typer.Exit(2)
    check_environment()
    logging.basicConfig(level=os.environ.get("MNEME_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s")
    from mneme.logrepeat import limit_repeats
    limit_repeats()  # a broker away: aiokafka logs every reconnect of every client
    overrides = {}
    if data_dir:
        overrides["data_dir"] = data_dir
    if address:
        overrides["grpc_address"] = address
    run_service(service, Settings(**overrides))


@app.command()
def banks(action: str = typer.Argument("list", help="list | create | get | update | delete | "
                                                    "check-llm | stats | profile"),
          bank_id: Optional[str] = typer.Argument(None),
          name: Optional[str] = typer.Option(None, "--name", help="create, update: display name"),
          set_: List[str] = typer.Option([], "--set", help="create, update: config FIELD=VALUE, e.g. "
                                         "retain_mission='...' (repeatable)"),
          retain_mission: Optional[str] = typer.Option(None, help="create, update: what retain extracts"),
          observations_mission: Optional[str] = typer.Option(
              None, help="create, update: what consolidation keeps as observations"),
          reflect_mission: Optional[str] = typer.Option(None, help="create, update: what reflect answers for"),
          skepticism: Optional[int] = typer.Option(None, min=1, max=5, help="create, update: 1..5"),
          literalism: Optional[int] = typer.Option(None, min=1, max=5, help="create, update: 1..5"),
          empathy: Optional[int] = typer.Option(None, min=1, max=5, help="create, update: 1..5"),
          auto_consolidate: Optional[bool] = typer.Option(
              None, "--auto-consolidate/--no-auto-consolidate", help="create, update"),
          extraction_mode: Optional[str] = typer.Option(None, help="create, update: auto, offline, llm or llm_only"),
          erasure: Optional[str] = typer.Option(None, help="create, update: crypto_shred or none"),
          store_documents: Optional[bool] = typer.Option(
              None, "--store-documents/--no-store-documents",
              help="create, update: keep retained documents' original text (GetDocument)"),
          as_json: bool = typer.Option(False, "--json", help="get, create, update: the bank as JSON"),
          address: str = AddressOpt):
    """List, create (or replace: the name and config given, defaults for the rest), show,
    update (only the fields given) or delete banks, or check the language models a bank
    uses."""
    flags = {k: v for k, v in (
        ("retain_mission", retain_mission), ("observations_mission", observations_mission),
        ("reflect_mission", reflect_mission), ("skepticism", skepticism),
        ("literalism", literalism), ("empathy", empathy), ("auto_consolidate", auto_consolidate),
        ("extraction_mode", extraction_mode), ("erasure", erasure),
        ("store_documents", store_documents)) if v is not None}
    if extraction_mode is not None:
        from mneme.domain import EXTRACTION_MODES
        _choice("--extraction-mode", extraction_mode, EXTRACTION_MODES)
    if erasure is not None:
        _choice("--erasure", erasure, ("crypto_shred", "none"))
    if action not in ("create", "update") and (flags or set_ or name is not None):
        console.print(f"banks {action}: --name, --set and config flags go with create or "
                      "update only", style="red")
        raise typer.Exit(2)
    if action == "stats" and bank_id:
        return _bank_stats(bank_id, address)
    if action == "profile" and bank_id:
        return _bank_profile(bank_id, as_json, address)
    with _session(address) as m:
        if action == "list":
            t = Table("bank", "display name", "created")
            for b in m.list_banks():
                t.add_row(b.name.split("/", 1)[1], b.display_name,
                          b.create_time.ToDatetime().isoformat(timespec="seconds"))
            _out().print(t)
        elif action == "check-llm" and bank_id:
            r = m.check_llm(bank_id)
            print(f"extraction: {r.extraction}")
            for c in r.checks:
                state = "ok" if c.ok else f"FAILED: {c.error}"
                print(f"  {c.operation:<13} {c.model:<40} {state} ({c.latency_s:.2f}s)")
            if not r.checks:
                print("  no language model configured: offline extraction, extractive reflect")
            if any(not c.ok for c in r.checks):
                raise typer.Exit(1)
        elif action == "update" and bank_id:
            if name is None and not set_ and not flags:
                console.print("nothing to change: give --name, a config flag "
                              "(--reflect-mission, --skepticism, ...) or --set FIELD=VALUE",
                              style="red")
                raise typer.Exit(2)
            b = m.update_bank(bank_id, display_name=name, **{**_config_fields(set_), **flags})
            _print_json(b) if as_json else _print_fields(b)
        elif action == "create" and bank_id:  # create or replace: config as given
            b = m.upsert_bank(bank_id, display_name=name or "",
                              **{**_config_fields(set_), **flags})
            _print_json(b) if as_json else _print_fields(b)
        elif action in ("get", "delete") and bank_id:
            b = {"get": m.get_bank}.get(action, m.delete_bank)(bank_id)
            if b is None:
                print(f"deleted {bank_id}")
            else:
                _print_json(b) if as_json else _print_fields(b)
        else:
            console.print("usage: mneme banks [list | create ID | get ID | update ID [--name N]"
                          " [--reflect-mission M] [--skepticism 1..5] ... [--set FIELD=VALUE]"
                          " | delete ID | check-llm ID | stats ID]")
            raise typer.Exit(2)


@app.command()
def retain(bank: str,
           content: Optional[str] = typer.Argument(None, help="text, or - to read stdin"),
           context: str = "", document_id: str = "", tag: List[str] = typer.Option([], "--tag"),
           timestamp: Optional[datetime] = typer.Option(None, help="when it happened (ISO 8601)"),
           time_zone: Optional[str] = typer.Option(
               None, "--time-zone", help="the zone it was said in, for relative dates: an "
               "IANA name (Europe/Paris) or an offset (+05:30); default: the --timestamp's "
               "offset, else UTC"),
           items: Optional[Path] = typer.Option(
               None, "--items", help="a JSON-lines file of items instead of CONTENT, one "
                                     "object each: content, context, timestamp (ISO 8601), "
                                     "time_zone, document_id, tags, metadata"),
           async_: bool = typer.Option(False, "--async"), address: str = AddressOpt):
    """Retain one item (CONTENT), or every item of an --items file, into BANK in one
    request (the bank is created if missing)."""
    if (content is None) == (items is None):
        console.print("give CONTENT or --items FILE (one of them)", style="red")
        raise typer.Exit(2)
    if items is not None and (context or document_id or tag or timestamp or time_zone):
        console.print("with --items, each line gives its own context, document_id, "
                      "tags, timestamp and time_zone", style="red")
        raise typer.Exit(2)
    if items is not None:
        batch = _items_file(items)
    else:
        text = sys.stdin.read() if content == "-" else content
        batch = [{"content": text, "context": context, "document_id": document_id,
                  "tags": tag, "timestamp": _aware(timestamp, time_zone), "time_zone": time_zone}]
    with _session(address) as m:
        m.upsert_bank(bank) if not _exists(m, bank) else None
        r = m.retain(bank, batch, async_=async_)
    op = r.operation
    print(f"{op.name}: {op.kind} {_state(op.state)}, {op.facts} facts"
          + (f", {len(op.item_errors)} items failed" if op.item_errors else ""))
    for mid in r.memory_ids:
        print(f"  {mid}")
    for e in op.item_errors:  # the other items are stored
        console.print(f"item {e.item_index} ({e.field or 'extraction'}): {e.error}",
                      style="yellow")
    from mneme.v1 import operations_pb2
    if op.state == operations_pb2.FAILED:  # every item failed
        if op.error:
            console.print(op.error, style="red")
        raise typer.Exit(1)


def _items_file(path: Path) -> list[dict]:
    """The retain items of a JSON-lines file (blank lines skipped); a ``timestamp`` is
    ISO 8601. Exits 2 naming the line of anything else."""
    out = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        console.print(f"--items {path}: {e}", style="red")
        raise typer.Exit(2)
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            if not isinstance(item, dict) or not isinstance(item.get("content"), str):
                raise ValueError("each line must be an object with a string 'content'")
            unknown = set(item) - {"content", "context", "timestamp", "time_zone",
                                   "document_id", "tags", "metadata"}
            if unknown:
                raise ValueError(f"unknown field(s) {sorted(unknown)}")
            for key in ("context", "document_id", "time_zone"):
                if not isinstance(item.get(key, ""), str):
                    raise ValueError(f"'{key}' must be a string")
            if not (isinstance(item.get("tags", []), list)
                    and all(isinstance(t, str) for t in item.get("tags", []))):
                raise ValueError("'tags' must be a list of strings")
            if not (isinstance(item.get("metadata", {}), dict)
                    and all(isinstance(v, str) for v in item.get("metadata", {}).values())):
                raise ValueError("'metadata' must be an object of strings")
            if item.get("timestamp") is not None:
                item["timestamp"] = _aware(datetime.fromisoformat(str(item["timestamp"])),
                                           item.get("time_zone"))
        except ValueError as e:
            console.print(f"--items {path}, line {n}: {e}", style="red")
            raise typer.Exit(2)
        out.append(item)
    if not out:
        console.print(f"--items {path}: no items", style="red")
        raise typer.Exit(2)
    return out


def _boolean(value: str) -> bool:
    """true/false, yes/no, 1/0 (any case); ValueError for anything else."""
    v = value.strip().lower()
    if v in ("1", "true", "yes"):
        return True
    if v in ("0", "false", "no"):
        return False
    raise ValueError(value)


def _int32(value: str) -> int:
    """An integer in a proto int32's range; ValueError otherwise."""
    n = int(value)
    if not INT32_MIN <= n <= INT32_MAX:
        raise ValueError(value)
    return n


def _config_fields(pairs: List[str]) -> dict:
    """``FIELD=VALUE`` strings → BankConfig keyword arguments, typed by the field."""
    from mneme.v1 import resources_pb2
    fields = resources_pb2.BankConfig.DESCRIPTOR.fields_by_name
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        fd = fields.get(key)
        if not sep or fd is None:
            console.print(f"invalid --set {pair!r}: FIELD=VALUE with FIELD one of "
                          f"{', '.join(fields)}", style="red")
            raise typer.Exit(2)
        try:
            out[key] = {fd.TYPE_BOOL: _boolean, fd.TYPE_INT32: _int32,
                        fd.TYPE_DOUBLE: float}.get(fd.type, str)(value)
        except ValueError:
            console.print(f"invalid --set {pair!r}: not a {key} value", style="red")
            raise typer.Exit(2)
    return out


def _exists(m, bank: str) -> bool:
    try:
        m.get_bank(bank)
        return True
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.NOT_FOUND:
            return False
        raise


def _state(s: int) -> str:
    from mneme.v1 import operations_pb2
    return operations_pb2.OperationState.Name(s).lower()


def _ended(op, said: str) -> None:
    """``said`` and the operation's state on stdout; when the operation FAILED, on
    stderr with its error instead, and exit 1."""
    from mneme.v1 import operations_pb2
    if op.state == operations_pb2.FAILED:
        console.print(f"{said}: failed" + (f" ({op.error})" if op.error else ""), style="red")
        raise typer.Exit(1)
    results.print(f"{said}: {_state(op.state)}")


@app.command()
def recall(bank: str, query: str,
           max_tokens: int = typer.Option(1024, min=0, max=INT32_MAX), budget: str = "mid",
           tag: List[str] = typer.Option([], "--tag"), tags_match: str = "any",
           type_: List[str] = typer.Option(
               [], "--type", help="world, experience, observation or opinion (repeatable; "
               "default: world and experience)"),
           at: Optional[datetime] = typer.Option(None, "--at", help="'now' for relative "
                                                 "expressions in the query (ISO 8601)"),
           time_zone: Optional[str] = typer.Option(None, "--time-zone", help=_ZONE_HELP),
           include_entities: Optional[int] = typer.Option(
               None, "--include-entities", min=0, max=INT32_MAX,
               help="also the entities the results mention, with observations, within "
               "this many tokens (0: the server's default, 500)"),
           include_documents: Optional[int] = typer.Option(
               None, "--include-documents", min=0, max=INT32_MAX,
               help="also the stored text of the documents the results come from, within "
               "this many tokens (0: the server's default, 8192)"),
           as_json: bool = typer.Option(False, "--json"), address: str = AddressOpt):
    """Recall the memories of BANK that matter for QUERY, with each arm's rank (and, when
    asked, the entities they mention and the documents they come from)."""
    from mneme.client import BUDGETS, TAGS_MATCH, TYPES
    _choice("--budget", budget, BUDGETS)
    _choice("--tags-match", tags_match, TAGS_MATCH)
    for t in type_:
        _choice("--type", t, TYPES)
    with _session(address) as m:
        r = m.recall(bank, query, max_tokens=max_tokens, budget=budget, tags=tag,
                     tags_match=tags_match, types=type_,
                     query_timestamp=_aware(at, time_zone), time_zone=time_zone,
                     include_entities=include_entities, include_documents=include_documents)
    if as_json:
        from google.protobuf.json_format import MessageToDict
        print(json.dumps(MessageToDict(r, preserving_proto_field_name=True), indent=1))
        return
    print_recall(r)
    out = _out()
    for e in r.entities:
        out.print(f"entity {e.display_name} ({e.kind}) {e.entity.rsplit('/', 1)[-1]}")
        for o in e.observations:
            out.print(f"  observation: {o.text}")
    for d in r.documents:
        cut = " (truncated)" if d.truncated else ""
        out.print(f"document {d.document_id}{cut}, {d.tokens} tokens:\n{d.text}")


def print_recall(r, limit: int | None = None) -> None:
    """Print recall results as a table (text, date, per-arm ranks)."""
    t = Table("#", "memory", "date", "sem", "bm25", "graph", "time", show_lines=False)
    for n, res in enumerate(r.results[:limit] if limit else r.results, 1):
        mem, s = res.memory, res.scores
        when = (mem.occurred_start if mem.HasField("occurred_start") else mem.mentioned_at)
        rank = lambda x: str(x) if x else "-"  # noqa: E731
        t.add_row(str(n), mem.text, when.ToDatetime().strftime("%Y-%m-%d"), rank(s.semantic_rank),
                  rank(s.keyword_rank), rank(s.graph_rank), rank(s.temporal_rank))
    _out().print(t)


@app.command()
def reflect(bank: str, query: str, context: str = "", budget: str = "mid",
            at: Optional[datetime] = typer.Option(None, "--at", help="when the question is "
                                                  "asked, for relative questions (ISO 8601)"),
            tag: List[str] = typer.Option([], "--tag", help="scope: what reflect reads, "
                                          "as recall's --tag (the directives with one of "
                                          "these tags apply too)"),
            tags_match: str = typer.Option("any", help="any, all, any_strict, all_strict "
                                           "or exact, as recall's"),
            max_tokens: int = typer.Option(0, min=0, max=INT32_MAX, help="most tokens of "
                                           "the answer (0: the server's default)"),
            time_zone: Optional[str] = typer.Option(None, "--time-zone", help=_ZONE_HELP),
            as_json: bool = typer.Option(False, "--json"), address: str = AddressOpt):
    """Answer QUERY by reasoning over BANK (extractive without a language model)."""
    from mneme.client import BUDGETS, TAGS_MATCH
    _choice("--budget", budget, BUDGETS)
    _choice("--tags-match", tags_match, TAGS_MATCH)
    with _session(address) as m:
        r = m.reflect(bank, query, context=context, budget=budget,
                      query_timestamp=_aware(at, time_zone), tags=tag, time_zone=time_zone,
                      tags_match=tags_match, max_tokens=max_tokens)
    if as_json:
        return _print_json(r)
    print(r.text)
    print(f"based on: {', '.join(r.based_on)}")
    if r.sources.directives:
        print(f"directives followed: {', '.join(r.sources.directives)}")


@app.command("import-locomo")
def import_locomo(file: Path, conversation: List[str] = typer.Option([], "--conversation", "-c"),
                  bank: Optional[str] = typer.Option(None, help="default: the conversation id"),
                  address: str = AddressOpt):
    """Retain LoCoMo conversations (every turn, session date as timestamp, dia_id in
    metadata), one bank per conversation, one sync retain per session."""
    from mneme import locomo
    convs = [c for c in locomo.load(file) if not conversation or c["sample_id"] in conversation]
    if not convs:
        console.print(f"no conversation {conversation} in {file}")
        raise typer.Exit(2)
    with _session(address) as m, _progress() as prog:
        for c in convs:
            bank_id = bank or c["sample_id"]
            sessions = locomo.sessions(c)
            task = prog.add_task(f"{c['sample_id']} → banks/{bank_id}",
                                 total=sum(len(s.items) for s in sessions))
            m.upsert_bank(bank_id, display_name=f"LoCoMo {c['sample_id']}")
            for s in sessions:
                m.retain(bank_id, s.items)
                prog.advance(task, len(s.items))


@app.command()
def keys(action: str = typer.Argument("list", help="create | list | revoke"),
         key_id: Optional[str] = typer.Argument(None, help="revoke: the key id"),
         bank: List[str] = typer.Option([], "--bank", "-b", help="bank id, repeatable; * for all"),
         scope: str = typer.Option("read", "--scope",
                                   help="read | write | history, or a comma-separated set "
                                        "(write,history); history: the data keys to decrypt "
                                        "the bank's event history"),
         subject: str = typer.Option("", "--subject", help="mTLS: client certificate CN"),
         data_dir: Path = typer.Option(None, "--data-dir", "-d")):
    """Manage API keys (MNEME_API_KEYS_FILE, default $MNEME_DATA_DIR/api_keys.json): only
    their hashes are stored; `create` prints the key once. A running server picks up
    changes to the file at once. Every key may read; `write` adds the writes, `history`
    the data keys of the bank's event history (KeyService, for consumers of the topics)."""
    from mneme.auth import KeyStore, default_keys_file, parse_scope
    from mneme.config import Settings
    store = KeyStore(default_keys_file(Settings(**({"data_dir": data_dir} if data_dir else {}))))
    if action == "create":
        try:
            key_id, key = store.add(bank, scope, subject)
            scope = parse_scope(scope)
        except ValueError as e:
            console.print(f"{e}", style="red")
            raise typer.Exit(2)
        console.print(f"created key {key_id} ({scope} on {', '.join(sorted(set(bank)))}) in "
                      f"{store.path}; it is shown only now:")
        print(key)
    elif action == "list":
        t = Table("id", "scope", "banks", "subject", "created")
        for e in store.entries():
            t.add_row(e.get("id", ""), e.get("scope", ""), ", ".join(e.get("banks", [])),
                      e.get("subject", ""), e.get("created", ""))
        _out().print(t)
    elif action == "revoke" and key_id:
        if not store.revoke(key_id):
            console.print(f"no key {key_id}", style="red")
            raise typer.Exit(1)
        results.print(f"revoked {key_id}")
    else:
        console.print("usage: mneme keys [list | create --bank B --scope read|write|history | "
                      "revoke ID]")
        raise typer.Exit(2)


@app.command()
def reconsolidate(bank: str, address: str = AddressOpt):
    """Re-derive BANK's observations from its facts with the current configuration (a
    running server; new ObservationsChanged events supersede the old ones)."""
    with _session(address) as m:
        op = m.consolidate(bank, reconsolidate=True)
        n = sum(1 for _ in m.list_observations(bank))
    _ended(op, f"reconsolidated {bank} ({n} observations)")


def _settings_of(data_dir: Optional[Path], embedded_log_only: bool = False):
    """The settings with ``data_dir`` (default ``MNEME_DATA_DIR`` or ./.mneme) for a
    command that reads what a data dir holds; exit 1 when that directory does not exist,
    rather than creating an empty one and reporting on it. ``embedded_log_only``: only
    when the event log is the data dir's own (a Kafka log can be replayed into a new
    data dir)."""
    from mneme.config import Settings
    settings = Settings(**({"data_dir": data_dir} if data_dir else {}))
    if not settings.data_dir.is_dir() and not (embedded_log_only and settings.bus_url):
        console.print(f"no data dir {settings.data_dir}", style="red")
        raise typer.Exit(1)
    return settings


@app.command("replay")
def replay_cmd(data_dir: Path = typer.Option(None, "--data-dir", "-d"),
               address: Optional[str] = typer.Option(
                   None, "--address", "-a", help="replay a running server's stores while it serves"),
               force: bool = typer.Option(False, "--force", help="switch even when the check "
                                          "finds the new generation differs from the live one"),
               each: bool = typer.Option(False, "--each", help="with --address: every address "
                                         "its host resolves to (a headless Service's replicas), "
                                         "one after the other")):
    """Rebuild search's stores (vectors, text, graph) from the event log into a new
    generation, check it against the live one (units per bank, sampled recalls) and
    switch to it. The retired generation's files are deleted MNEME_RETIRE_GRACE_S (30 s)
    after the switch, at once with the server stopped; on store servers the search
    replicas share it stays until `mneme generations drop`. Calls no model: derived
    events carry facts and vectors. A failed replay changes nothing.

    With --address, a running server (`mneme up`, or a search replica with local store
    files) replays while it serves. Without, the data dir's server must be stopped; the
    catalog and consolidation's projection are rebuilt too (with MNEME_BUS_URL=kafka://…,
    search's catalog: stop that search replica first)."""
    if address:
        failed = 0
        targets = _each_address(address) if each else [address]
        for target in targets:
            if each:
                console.print(f"replica {target}")
            with _client(target) as m, _progress() as prog:
                task = prog.add_task("replaying the log", total=None)
                try:
                    g = m.replay(force=force, progress=lambda d, t: prog.update(
                        task, completed=d, total=t or None))
                except grpc.RpcError as e:
                    if not each:
                        _fail(e)
                    console.print(f"{e.code().name}: {e.details()}", style="red")
                    failed += 1
                    continue
            failed += not _report_generation(g)
        if failed:
            raise typer.Exit(1)
        return
    from mneme.datadir import DataDirLocked
    from mneme.runtime import allocator
    from mneme.runtime.replay import ReplayFailed, replay
    from mneme.bus import StaleCommitError

    allocator.tune()
    settings = _settings_of(data_dir, embedded_log_only=True)
    with _progress() as prog:
        task = prog.add_task("replaying the log", total=None)

        def progress(done: int, total: int) -> None:
            prog.update(task, completed=done, total=total)
        from mneme.bus.sqlite_log import LogDamaged
        try:
            stats = replay(settings, progress, force=force)
        except (DataDirLocked, LogDamaged, ReplayFailed) as e:
            console.print(f"{e}", style="red")
            if isinstance(e, DataDirLocked):
                console.print("a running server replays while it serves: "
                              "mneme replay --address HOST:PORT")
            elif isinstance(e, ReplayFailed) and e.generation.check.get("problems"):
                console.print("to switch anyway (the live generation is damaged): --force")
            raise typer.Exit(1)
        except StaleCommitError as e:  # Kafka: the search group still has members
            console.print(f"stop the search processes first: {e}", style="red")
            raise typer.Exit(1)
    g = stats["generation"]
    if stats["state"] == "READY":  # store servers the search replicas share
        results.print(f"replayed {stats['records']} records into generation {g}, checked; "
                      f"to switch, set MNEME_STORE_GENERATION={g} on the search replicas "
                      f"(Helm: storeGeneration) and roll them; then `mneme generations drop "
                      f"{g - 1}`")
    else:
        # the two phases' records: what `generations list` counts, then the catalogs'
        results.print(f"replayed {stats['records']} records; generation {g} is live "
                      f"({stats['generation_records']} into its stores, "
                      f"{stats['catalog_records']} rebuilding the catalogs, "
                      f"{stats.get('resolver_records', 0)} the entity resolver)")


@app.command("reembed")
def reembed_cmd(model: str = typer.Option(..., "--model", "-m", help="the new embedding model "
                                          "(one of MNEME_EMBEDDING_MODEL's choices)"),
                data_dir: Path = typer.Option(None, "--data-dir", "-d"),
                force: bool = typer.Option(False, "--force", help="switch even when the "
                                           "check finds the new generation differs")):
    """Move a stopped server's data dir to another embedding model: every fact,
    observation and opinion of every bank is embedded with MODEL and appended to the log
    (VectorsReplaced events), then the stores are rebuilt by replay into a new generation
    under MODEL, checked and switched; the data dir's model becomes MODEL (serve it with
    MNEME_EMBEDDING_MODEL=MODEL from then on). Replay stays model-free afterwards. A
    failed or interrupted re-embed changes nothing live (the old model still serves);
    running it again is safe. Embedded data dirs only."""
    from mneme.datadir import DataDirLocked
    from mneme.embedding import MODELS
    from mneme.runtime.reembed import ReembedRefused, reembed
    from mneme.runtime.replay import ReplayFailed
    from mneme.bus.sqlite_log import LogDamaged

    if model not in MODELS:
        console.print(f"unknown embedding model {model!r}; choose one of "
                      f"{', '.join(sorted(MODELS))}", style="red")
        raise typer.Exit(2)
    settings = _settings_of(data_dir, embedded_log_only=True)
    with _progress() as prog:
        tasks: dict[str, object] = {}

        def progress(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                label = ("embedding units with " + model if stage == "embedding"
                         else "replaying the log")
                tasks[stage] = prog.add_task(label, total=None)
            prog.update(tasks[stage], completed=done, total=total or None)
        try:
            out = reembed(settings, model, progress, force=force)
        except (DataDirLocked, LogDamaged, ReplayFailed, ReembedRefused) as e:
            console.print(f"{e}", style="red")
            if isinstance(e, DataDirLocked):
                console.print("stop the server first (mneme reembed works on a stopped "
                              "server's data dir)")
            console.print("nothing changed: the data dir still serves under its model")
            raise typer.Exit(1)
    if out["state"] == "UNCHANGED":
        console.print(f"the data dir already holds {model} vectors"
                      + ("" if out["previous_model"] else " (none yet)") + "; nothing to do")
        return
    results.print(f"re-embedded {out['units']} units of {out['banks']} banks with {model} "
                  f"(was {out['previous_model']}): {out['events']} events appended, "
                  f"{out['records']} records replayed; generation {out['generation']} is "
                  f"live. Serve with MNEME_EMBEDDING_MODEL={model}")


def _each_address(address: str) -> list[str]:
    """Every ``ip:port`` that ``host:port`` resolves to (a headless Service lists its
    ready pods); with TLS the certificate is still checked against the host's name."""
    import socket
    host, _, port = address.rpartition(":")
    if not host or not (port.isascii() and port.isdigit()):
        console.print(f"--address must be HOST:PORT, got {address!r}", style="red")
        raise typer.Exit(2)
    try:
        infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except OSError as e:
        console.print(f"cannot resolve {host}: {e}", style="red")
        raise typer.Exit(1)
    if any(os.environ.get(f"MNEME_CLIENT_TLS_{k}") for k in ("CA", "CERT", "KEY")):
        os.environ.setdefault("MNEME_CLIENT_TLS_SERVER_NAME", host.strip("[]"))
    ips = sorted({i[4][0] for i in infos})
    return [f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips]


def _report_generation(g) -> bool:
    """Print a generation's outcome; False when it FAILED."""
    from mneme.v1 import generations_pb2
    state = generations_pb2.Generation.State.Name(g.state)
    console.print(f"generation {g.generation}: {state}, {g.records_done} records, "
                  f"{g.check.banks} banks, {g.check.units} units, {g.check.recalls} recalls "
                  f"agreeing {g.check.agreement:.2f}"
                  + (f", {g.check.gained} banks repaired" if g.check.gained else "")
                  + (f", {g.check.moving} banks written meanwhile" if g.check.moving else ""))
    for p in g.check.problems:
        console.print(f"  {p}", style="yellow")
    if g.state == generations_pb2.Generation.FAILED:
        console.print(f"{g.error} (the live generation is unchanged)", style="red")
        return False
    return True


generations_app = typer.Typer(rich_markup_mode="markdown", help="Generations of search's stores (see `mneme replay`).",
                              no_args_is_help=True)
app.add_typer(generations_app, name="generations")


@generations_app.command("list")
def generations_list(address: Optional[str] = typer.Option(
                         os.environ.get("MNEME_ADDRESS"), "--address", "-a",
                         help="a running server (default: MNEME_ADDRESS when set)"),
                     data_dir: Path = typer.Option(None, "--data-dir", "-d")):
    """List the generations of a running server (--address) or of a data dir (--data-dir,
    which wins; default MNEME_DATA_DIR or ./.mneme)."""
    from datetime import datetime, timezone

    def when(seconds: float) -> str:  # generation 1 before any replay has no time
        return (datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="seconds")
                if seconds else "-")
    t = Table("generation", "state", "records", "units checked", "updated", "error")
    if address and data_dir is None:
        from mneme.v1 import generations_pb2
        with _session(address) as m:
            for g in m.list_generations():
                t.add_row(str(g.generation), generations_pb2.Generation.State.Name(g.state),
                          str(g.records_done), str(g.check.units),
                          when(g.update_time.seconds), g.error)
    else:
        from mneme.generations import Generations, configured
        st = _settings_of(data_dir)
        for g in Generations(st.data_dir.resolve(), configured(st)).list():
            t.add_row(str(g.generation), g.state, str(g.records_done),
                      str(g.check.get("units", "")), when(g.update_time), g.error)
    _out().print(t)


@generations_app.command("drop")
def generations_drop(generation: int,
                     address: Optional[str] = typer.Option(None, "--address", "-a"),
                     data_dir: Path = typer.Option(None, "--data-dir", "-d")):
    """Delete a generation that is not live (RETIRED, FAILED or READY; a BUILDING one's
    replay is cancelled first), on a running server (--address) or in a stopped server's
    data dir."""
    if address:
        with _session(address) as m:
            m.delete_generation(generation)
    else:
        from mneme.datadir import DataDirLocked
        from mneme.runtime.replay import drop_generation
        settings = _settings_of(data_dir)
        try:
            drop_generation(settings, generation)
        except (DataDirLocked, KeyError, ValueError) as e:
            console.print(str(e) if not isinstance(e, KeyError) else f"no generation {generation}",
                          style="red")
            raise typer.Exit(1)
    results.print(f"dropped generation {generation}")


def _print_json(messages) -> None:
    """Protobuf messages as JSON on stdout (one object, or a list): proto field names,
    times as RFC 3339, full ids."""
    from google.protobuf.json_format import MessageToDict

    def one(msg):
        return MessageToDict(msg, preserving_proto_field_name=True)
    out = [one(x) for x in messages] if isinstance(messages, list) else one(messages)
    print(json.dumps(out, indent=1, ensure_ascii=False))


def _print_fields(msg) -> None:
    """A protobuf message for reading on stdout: one "field: value" line per set field,
    nested messages indented, times as RFC 3339 (the proto's text format prints seconds
    and nanos)."""
    from google.protobuf.json_format import MessageToDict

    def shown(v) -> str:  # one line each: JSON for what is not a plain one-line string
        return (_visible(v) if isinstance(v, str) and "\n" not in v
                else json.dumps(v, ensure_ascii=False))

    def lines(d: dict, indent: str):
        for k, v in d.items():
            if isinstance(v, dict):
                print(f"{indent}{k}:")
                lines(v, indent + "  ")
            else:
                print(f"{indent}{k}: {shown(v)}")
    lines(MessageToDict(msg, preserving_proto_field_name=True), "")


def _table(*columns: str, ids: tuple[str, ...] = ()) -> Table:
    """A table that never cuts a value: ``ids`` columns are neither cut nor wrapped (full
    ids, for copying); the others wrap, long words folded instead of ellipsised."""
    t = Table()
    for c in columns:
        if c in ids:
            t.add_column(c, no_wrap=True, min_width=36, overflow="ignore")
        else:
            t.add_column(c, overflow="fold")
    return t


def _listed(pages, limit: int) -> list:
    """At most ``limit`` items of an SDK list generator (0: all); RPC errors end the
    command (exit 2)."""
    out = []
    try:
        for x in pages:
            if limit and len(out) >= limit:
                break
            out.append(x)
    except grpc.RpcError as e:
        _fail(e)
    return out


directives_app = typer.Typer(rich_markup_mode="markdown", help="Directives: hard rules reflect follows in a bank.",
                              no_args_is_help=True)
app.add_typer(directives_app, name="directives")


def _print_directive(d) -> None:
    state = "active" if d.active else "inactive"
    scope = f"tags {', '.join(d.tags)}" if d.tags else "every reflect"
    print(f"{d.id}  ({state}, priority {d.priority}, {scope})  {d.title}\n  {d.text}")


@directives_app.command("create")
def directives_create(bank: str, text: str = typer.Argument(..., help="the rule, e.g. 'Answer in German.'"),
                      title: str = typer.Option("", help="a short label"),
                      priority: int = typer.Option(0, min=INT32_MIN, max=INT32_MAX,
                                                   help="higher first when several apply"),
                      inactive: bool = typer.Option(False, "--inactive", help="keep it but do not apply it"),
                      tag: List[str] = typer.Option([], "--tag", help="scope: applies to reflects with one of these tags"),
                      as_json: bool = typer.Option(False, "--json"), address: str = AddressOpt):
    """Create a directive in BANK."""
    with _session(address) as m:
        d = m.create_directive(bank, text, title=title, priority=priority,
                               active=not inactive, tags=tag)
    _print_json(d) if as_json else _print_directive(d)


@directives_app.command("list")
def directives_list(bank: str, as_json: bool = typer.Option(False, "--json"),
                    address: str = AddressOpt):
    """List BANK's directives in id order."""
    with _client(address) as m:
        found = _listed(m.list_directives(bank), 0)
    if as_json:
        return _print_json(found)
    t = _table("directive", "priority", "active", "tags", "title", "text", ids=("directive",))
    for d in found:
        t.add_row(d.id, str(d.priority), "yes" if d.active else "no", ", ".join(d.tags), d.title, d.text)
    _out().print(t)


@directives_app.command("get")
def directives_get(bank: str, directive_id: str, as_json: bool = typer.Option(False, "--json"),
                   address: str = AddressOpt):
    """Show one directive."""
    with _session(address) as m:
        d = m.get_directive(bank, directive_id)
    _print_json(d) if as_json else _print_directive(d)


@directives_app.command("update")
def directives_update(bank: str, directive_id: str,
                      text: Optional[str] = typer.Option(None, help="new rule text"),
                      title: Optional[str] = typer.Option(None),
                      priority: Optional[int] = typer.Option(None, min=INT32_MIN, max=INT32_MAX),
                      active: Optional[bool] = typer.Option(None, "--active/--inactive"),
                      tag: Optional[List[str]] = typer.Option(None, "--tag", help="replaces the tags"),
                      clear_tags: bool = typer.Option(False, "--clear-tags", help="remove every tag"),
                      as_json: bool = typer.Option(False, "--json"), address: str = AddressOpt):
    """Change only the given fields of a directive."""
    fields = {k: v for k, v in (("text", text), ("title", title), ("priority", priority),
                                ("active", active)) if v is not None}
    if tag or clear_tags:
        fields["tags"] = [] if clear_tags else tag
    if not fields:
        console.print("nothing to change: give --text, --title, --priority, "
                      "--active/--inactive, --tag or --clear-tags", style="red")
        raise typer.Exit(2)
    with _session(address) as m:
        d = m.update_directive(bank, directive_id, **fields)
    _print_json(d) if as_json else _print_directive(d)


@directives_app.command("delete")
def directives_delete(bank: str, directive_id: str, address: str = AddressOpt):
    """Delete a directive."""
    with _session(address) as m:
        m.delete_directive(bank, directive_id)
    results.print(f"deleted directive {directive_id}")


memories_app = typer.Typer(rich_markup_mode="markdown", help="A bank's memories (facts): list, show, delete.",
                           no_args_is_help=True)
app.add_typer(memories_app, name="memories")


def _when(ts) -> str:
    return ts.ToDatetime(timezone.utc).isoformat() if ts.seconds or ts.nanos else ""


@memories_app.command("list")
def memories_list(bank: str, document_id: str = typer.Option("", help="only this document's"),
                  limit: int = typer.Option(0, min=0, help="at most this many (0: all)"),
                  as_json: bool = typer.Option(False, "--json"), address: str = AddressOpt):
    """List BANK's memories (facts) in a stable order."""
    with _client(address) as m:
        found = _listed(m.list_memories(bank, document_id=document_id), limit)
    if as_json:
        return _print_json(found)
    from mneme.v1 import resources_pb2
    t = _table("memory", "type", "occurred", "document", "text", ids=("memory",))
    for x in found:
        t.add_row(x.id, resources_pb2.FactType.Name(x.fact_type).lower(),
                  _when(x.occurred_start), x.document_id, x.text)
    _out().print(t)


@memories_app.command("get")
def memories_get(bank: str, memory_id: str, as_json: bool = typer.Option(False, "--json"),
                 address: str = AddressOpt):
    """Show one memory with its times, entities and metadata."""
    with _session(address) as m:
        x = m.get_memory(bank, memory_id)
    if as_json:
        return _print_json(x)
    print(f"{x.id}  {x.text}")
    for label, ts in (("occurred", x.occurred_start), ("until", x.occurred_end),
                      ("mentioned", x.mentioned_at)):
        if _when(ts):
            print(f"  {label}: {_when(ts)}")
    if x.entities:
        print(f"  entities: {', '.join(f'{e.name} ({e.label})' for e in x.entities)}")
    if x.document_id:
        print(f"  document: {x.document_id}")


@memories_app.command("delete")
def memories_delete(bank: str, memory_id: str, address: str = AddressOpt):
    """Delete one memory (and the observations it alone supported); exit 1 when the
    bank holds no such memory ("memory not found")."""
    with _session(address) as m:
        op = m.delete_memory(bank, memory_id)
    _ended(op, f"deleted memory {memory_id}")


observations_app = typer.Typer(rich_markup_mode="markdown", help="A bank's observations: list, show, scopes, consolidate, "
                               "clear.", no_args_is_help=True)
app.add_typer(observations_app, name="observations")


@observations_app.command("list")
def observations_list(bank: str, scope: Optional[List[str]] = typer.Option(
                          None, "--scope", help="only this exact scope (its tags)"),
                      global_scope: bool = typer.Option(False, "--global", help="only the untagged scope"),
                      limit: int = typer.Option(0, min=0, help="at most this many (0: all)"),
                      as_json: bool = typer.Option(False, "--json"), address: str = AddressOpt):
    """List BANK's observations (of one scope with --scope or --global)."""
    exact = [] if global_scope else scope
    with _client(address) as m:
        found = _listed(m.list_observations(bank, scope=exact), limit)
    if as_json:
        return _print_json(found)
    t = _table("observation", "proof", "scope", "text", ids=("observation",))
    for o in found:
        t.add_row(o.id, str(o.proof_count), ", ".join(o.scope) or "(global)", o.text)
    _out().print(t)


@observations_app.command("get")
def observations_get(bank: str, observation_id: str,
                     as_json: bool = typer.Option(False, "--json"), address: str = AddressOpt):
    """Show one observation with its evidence and history."""
    with _session(address) as m:
        o = m.get_observation(bank, observation_id)
    if as_json:
        return _print_json(o)
    print(f"{o.id}  (proof {o.proof_count}, scope {', '.join(o.scope) or 'global'})\n  {o.text}")
    for ev in o.evidence:
        print(f"  evidence {ev.memory_id}: \"{ev.quote}\"")
    for h in o.history:
        print(f"  was: {h.text}")


@observations_app.command("scopes")
def observations_scopes(bank: str, as_json: bool = typer.Option(False, "--json"),
                        address: str = AddressOpt):
    """List the scopes of BANK's observations with their counts."""
    with _session(address) as m:
        scopes = m.list_observation_scopes(bank)
    if as_json:
        return _print_json(scopes)
    t = _table("scope", "observations")
    for s in scopes:
        t.add_row(", ".join(s.tags) or "(global)", str(s.observations))
    _out().print(t)


@observations_app.command("consolidate")
def observations_consolidate(bank: str, address: str = AddressOpt):
    """Consolidate BANK's pending facts now (waits for the operation)."""
    with _session(address) as m:
        op = m.consolidate(bank)
    _ended(op, f"consolidated {bank}")


@observations_app.command("clear")
def observations_clear(bank: str, memory_id: str = typer.Option("", help="only those of this memory"),
                       address: str = AddressOpt):
    """Delete BANK's observations (or those one memory supports)."""
    with _session(address) as m:
        op = m.clear_observations(bank, memory_id)
    _ended(op, f"cleared observations of {bank}")


opinions_app = typer.Typer(rich_markup_mode="markdown", help="Opinions: beliefs the bank formed when it reflected (list, "
                           "show with history, delete).", no_args_is_help=True)
app.add_typer(opinions_app, name="opinions")


@opinions_app.command("list")
def opinions_list(bank: str, entity: str = typer.Option("", help="only those about this entity id"),
                  limit: int = typer.Option(0, min=0, help="at most this many (0: all)"),
                  as_json: bool = typer.Option(False, "--json"), address: str = AddressOpt):
    """List BANK's opinions with their confidence."""
    with _client(address) as m:
        found = _listed(m.list_opinions(bank, entity_id=entity), limit)
    if as_json:
        return _print_json(found)
    t = _table("opinion", "confidence", "entities", "text", ids=("opinion",))
    for o in found:
        t.add_row(o.id, f"{o.confidence:.2f}", ", ".join(e.name for e in o.entities), o.text)
    _out().print(t)


@opinions_app.command("get")
def opinions_get(bank: str, opinion_id: str, as_json: bool = typer.Option(False, "--json"),
                 address: str = AddressOpt):
    """Show one opinion with its evidence and every change of its confidence."""
    with _session(address) as m:
        o = m.get_opinion(bank, opinion_id)
    if as_json:
        return _print_json(o)
    print(f"{o.id}  (confidence {o.confidence:.2f})\n  {o.text}")
    if o.entities:
        print(f"  about: {', '.join(f'{e.name} ({e.id})' for e in o.entities)}")
    for e in o.evidence:
        print(f"  evidence: {e.rsplit('/', 1)[-1]}")
    for h in o.history:
        cause = f" by {h.memory.rsplit('/', 1)[-1]}" if h.memory else ""
        print(f"  {_when(h.time) or '-'}  {h.change}{cause} -> {h.confidence:.4f}: {h.text}")


@opinions_app.command("delete")
def opinions_delete(bank: str, opinion_id: str, address: str = AddressOpt):
    """Delete one opinion (waits for the operation)."""
    with _session(address) as m:
        op = m.delete_opinion(bank, opinion_id)
    _ended(op, f"deleted opinion {opinion_id}")


models_app = typer.Typer(rich_markup_mode="markdown", help="Mental models: named standing answers reflect searches first.",
                         no_args_is_help=True)
app.add_typer(models_app, name="mental-models")
_POLICIES = ("manual", "after_consolidation", "every_n_facts")


def _print_model(m) -> None:
    refreshed = (m.refresh_time.ToDatetime(timezone.utc).isoformat() if m.HasField("refresh_time")
                 else "never")
    print(f"{m.id}  {m.display_name}  (revision {m.revision}, "
          f"{'STALE' if m.is_stale else 'fresh'}, refreshed {refreshed})")
    print(f"  answers: {m.source_query}")
    if m.tags:
        print(f"  tags: {', '.join(m.tags)}")
    for line in (m.content or "(no content yet: refresh it)").splitlines():
        print(f"  {line}")


@models_app.command("create")
def models_create(bank: str, display_name: str = typer.Argument(..., help="its name"),
                  source_query: str = typer.Argument(..., help="the question it answers"),
                  content: str = typer.Option("", help="a first answer (else: refresh it)"),
                  tag: List[str] = typer.Option([], "--tag", help="its scope"),
                  max_tokens: int = typer.Option(0, min=0, max=INT32_MAX,
                                                 help="most tokens a refresh stores (0: 2048)"),
                  refresh_policy: str = typer.Option("manual", help=", ".join(_POLICIES)),
                  refresh_every: int = typer.Option(0, min=0, max=INT32_MAX,
                                                    help="new facts between refreshes"),
                  as_json: bool = typer.Option(False, "--json"), address: str = AddressOpt):
    """Create a mental model in BANK."""
    _choice("--refresh-policy", refresh_policy, _POLICIES)
    with _session(address) as m:
        mm = m.create_mental_model(bank, display_name, source_query, content=content, tags=tag,
                                   max_tokens=max_tokens, refresh_policy=refresh_policy,
                                   refresh_every=refresh_every)
    _print_json(mm) if as_json else _print_model(mm)


@models_app.command("list")
def models_list(bank: str, tag: List[str] = typer.Option([], "--tag", help="only these scopes"),
                tags_match: str = typer.Option("any", help="any, all, any_strict, all_strict "
                                               "or exact (as recall's)"),
                as_json: bool = typer.Option(False, "--json"), address: str = AddressOpt):
    """List BANK's mental models in id order."""
    from mneme.client import TAGS_MATCH
    _choice("--tags-match", tags_match, TAGS_MATCH)
    with _client(address) as m:
        found = _listed(m.list_mental_models(bank, tags=tag, tags_match=tags_match), 0)
    if as_json:
        return _print_json(found)
    t = _table("mental model", "name", "revision", "state", "tags", "answers", ids=("mental model",))
    for mm in found:
        t.add_row(mm.id, mm.display_name, str(mm.revision), "stale" if mm.is_stale else "fresh",
                  ", ".join(mm.tags), mm.source_query)
    _out().print(t)


@models_app.command("get")
def models_get(bank: str, model_id: str, as_json: bool = typer.Option(False, "--json"),
               address: str = AddressOpt):
    """Show one mental model with its content."""
    with _session(address) as m:
        mm = m.get_mental_model(bank, model_id)
    _print_json(mm) if as_json else _print_model(mm)


@models_app.command("update")
def models_update(bank: str, model_id: str,
                  display_name: Optional[str] = typer.Option(None, "--name"),
                  source_query: Optional[str] = typer.Option(None, "--query"),
                  content: Optional[str] = typer.Option(None),
                  tag: Optional[List[str]] = typer.Option(None, "--tag", help="replaces the tags"),
                  clear_tags: bool = typer.Option(False, "--clear-tags"),
                  max_tokens: Optional[int] = typer.Option(None, min=0, max=INT32_MAX),
                  refresh_policy: Optional[str] = typer.Option(None, help=", ".join(_POLICIES)),
                  refresh_every: Optional[int] = typer.Option(None, min=0, max=INT32_MAX),
                  as_json: bool = typer.Option(False, "--json"), address: str = AddressOpt):
    """Change only the given fields of a mental model."""
    if refresh_policy is not None:
        _choice("--refresh-policy", refresh_policy, _POLICIES)
    fields = {k: v for k, v in (("display_name", display_name), ("source_query", source_query),
                                ("content", content), ("max_tokens", max_tokens),
                                ("refresh_policy", refresh_policy),
                                ("refresh_every", refresh_every)) if v is not None}
    if tag or clear_tags:
        fields["tags"] = [] if clear_tags else tag
    if not fields:
        console.print("nothing to change: give --name, --query, --content, --tag, "
                      "--clear-tags, --max-tokens, --refresh-policy or --refresh-every",
                      style="red")
        raise typer.Exit(2)
    with _session(address) as m:
        mm = m.update_mental_model(bank, model_id, **fields)
    _print_json(mm) if as_json else _print_model(mm)


@models_app.command("refresh")
def models_refresh(bank: str, model_id: str,
                   budget: str = typer.Option("mid", help="low, mid, high"),
                   mode: str = typer.Option("full", help="full (answer its question again) or "
                                            "delta (revise it with what changed since)"),
                   dry_run: bool = typer.Option(False, "--dry-run", help="show, do not store"),
                   as_json: bool = typer.Option(False, "--json"), address: str = AddressOpt):
    """Answer the model's question again (reflect), or revise its content with what changed
    in its scope since (--mode delta), and store it as a new revision."""
    from mneme.client import BUDGETS, REFRESH_MODES
    _choice("--budget", budget, BUDGETS)
    _choice("--mode", mode, REFRESH_MODES)
    with _session(address) as m:
        mm = m.refresh_mental_model(bank, model_id, budget=budget, dry_run=dry_run,
                                    mode=mode)
    _print_json(mm) if as_json else _print_model(mm)


@models_app.command("history")
def models_history(bank: str, model_id: str, as_json: bool = typer.Option(False, "--json"),
                   address: str = AddressOpt):
    """Every revision of a mental model's content, oldest first."""
    with _session(address) as m:
        revs = m.mental_model_revisions(bank, model_id)
    if as_json:
        return _print_json(revs)
    from mneme.v1 import mental_models_pb2
    for r in revs:
        how = (f"{r.source}, {mental_models_pb2.RefreshMode.Name(r.mode).lower()}" if r.mode
               else r.source)
        print(f"revision {r.revision} ({how}, "
              f"{r.create_time.ToDatetime(timezone.utc).isoformat()}), based on "
              f"{len(r.based_on)} memories")
        for line in r.content.splitlines():
            print(f"  {line}")


@models_app.command("clear")
def models_clear(bank: str, model_id: str, as_json: bool = typer.Option(False, "--json"),
                 address: str = AddressOpt):
    """Empty a mental model's content until its next refresh (its history stays)."""
    with _session(address) as m:
        mm = m.clear_mental_model(bank, model_id)
    if as_json:
        return _print_json(mm)
    results.print(f"cleared mental model {model_id}: revision {mm.revision}")


@models_app.command("delete")
def models_delete(bank: str, model_id: str, address: str = AddressOpt):
    """Delete a mental model and its history."""
    with _session(address) as m:
        m.delete_mental_model(bank, model_id)
    results.print(f"deleted mental model {model_id}")


entities_app = typer.Typer(rich_markup_mode="markdown", help="The entities a bank's memories mention.", no_args_is_help=True)
app.add_typer(entities_app, name="entities")


@entities_app.command("list")
def entities_list(bank: str, limit: int = typer.Option(0, min=0, help="at most this many (0: all)"),
                  tag: List[str] = typer.Option([], "--tag", help="only entities memories with "
                                                "these tags mention, counted over those"),
                  tags_match: str = typer.Option("any", help="any, all, any_strict, all_strict "
                                                 "or exact (as recall's)"),
                  as_json: bool = typer.Option(False, "--json"), address: str = AddressOpt):
    """List BANK's entities in id order with their kind, mention count and the earliest and
    latest time of the memories mentioning them (when told; else when it happened). With
    --tag: only the memories matching the tags count (--tags-match as in recall)."""
    from mneme.client import TAGS_MATCH
    _choice("--tags-match", tags_match, TAGS_MATCH)
    with _client(address) as m:
        found = _listed(m.list_entities(bank, tags=tag, tags_match=tags_match), limit)
    if as_json:
        return _print_json(found)
    t = _table("entity", "name", "kind", "mentions", "first seen", "last seen", "aliases",
               ids=("entity",))
    for e in found:
        t.add_row(e.id, e.display_name, e.kind, str(e.mention_count), _seen(e, "first_seen"),
                  _seen(e, "last_seen"), ", ".join(e.aliases))
    _out().print(t)


@entities_app.command("get")
def entities_get(bank: str, entity_id: str,
                 tag: List[str] = typer.Option([], "--tag", help="only the memories with these "
                                               "tags count"),
                 tags_match: str = typer.Option("any", help="any, all, any_strict, all_strict "
                                                "or exact (as recall's)"),
                 as_json: bool = typer.Option(False, "--json"), address: str = AddressOpt):
    """Show one entity: aliases, the memories mentioning it, its neighbours. With --tag:
    over the memories matching the tags only (--tags-match as in recall); not found when
    none of them mentions it."""
    from mneme.client import TAGS_MATCH
    _choice("--tags-match", tags_match, TAGS_MATCH)
    with _session(address) as m:
        e = m.get_entity(bank, entity_id, tags=tag, tags_match=tags_match)
    if as_json:
        return _print_json(e)
    out = _out()
    out.print(f"{e.display_name} ({e.kind}) {e.id}: {e.mention_count} mentions; "
              f"aliases: {', '.join(e.aliases)}")
    out.print(f"first seen {_seen(e, 'first_seen')}, last seen {_seen(e, 'last_seen')}")
    t = _table("neighbour", "name", "kind", "shared memories", ids=("neighbour",))
    for n in e.neighbours:
        t.add_row(n.entity.rsplit("/", 1)[-1], n.display_name, n.kind, str(n.shared_memories))
    out.print(t)
    for name in e.memories:
        out.print(name)


def _seen(e, field: str) -> str:
    """An Entity's first_seen/last_seen as ISO 8601 UTC, '-' when unset."""
    if not e.HasField(field):
        return "-"
    return getattr(e, field).ToDatetime(tzinfo=timezone.utc).isoformat()


def _print_entity(out: Console, e) -> None:
    out.print(f"{e.display_name} ({e.kind}) {e.id}: {e.mention_count} mentions; "
              f"aliases: {', '.join(e.aliases)}")


@entities_app.command("merge")
def entities_merge(bank: str,
                   entity_ids: list[str] = typer.Argument(..., help="2 to 100 entity ids; the "
                                                          "first one stays"),
                   name: str = typer.Option("", "--name", help="the merged entity's new "
                                            "display name (default: the first one's)"),
                   as_json: bool = typer.Option(False, "--json"), address: str = AddressOpt):
    """Merge entities of BANK that are one: the first takes the others' aliases and
    memories; later mentions of any of their names resolve to it."""
    with _session(address) as m:
        e = m.merge_entities(bank, entity_ids, name)
    if as_json:
        return _print_json(e)
    _print_entity(_out(), e)


@entities_app.command("split")
def entities_split(bank: str, entity_id: str,
                   name: str = typer.Option(..., "--name", help="the new entity's display name"),
                   alias: list[str] = typer.Option([], "--alias", help="an alias the new entity "
                                                   "takes, with the memories naming it "
                                                   "(repeatable)"),
                   memory: list[str] = typer.Option([], "--memory", help="a memory id that "
                                                    "mentions the new entity instead "
                                                    "(repeatable)"),
                   as_json: bool = typer.Option(False, "--json"), address: str = AddressOpt):
    """Split a new entity off ENTITY_ID of BANK: it takes the given aliases (and the
    memories naming them) and memories; later mentions of a moved alias resolve to it."""
    with _session(address) as m:
        r = m.split_entity(bank, entity_id, name, alias, memory)
    if as_json:
        return _print_json(r)
    out = _out()
    _print_entity(out, r.entity)
    _print_entity(out, r.new_entity)


documents_app = typer.Typer(rich_markup_mode="markdown", help="The documents of a bank's memories.", no_args_is_help=True)
app.add_typer(documents_app, name="documents")


@documents_app.command("list")
def documents_list(bank: str, limit: int = typer.Option(0, min=0, help="at most this many (0: all)"),
                   as_json: bool = typer.Option(False, "--json"), address: str = AddressOpt):
    """List BANK's documents in id order with how many memories and revisions each has
    and when it was last retained."""
    with _client(address) as m:
        docs = _listed(m.list_documents(bank), limit)
    if as_json:
        return _print_json(docs)
    t = _table("document", "memories", "revisions", "last retained")
    for d in docs:
        t.add_row(d.document_id, str(d.memory_count), str(d.revision_count),
                  d.update_time.ToDatetime(timezone.utc).isoformat(timespec="seconds")
                  if d.HasField("update_time") else "")
    _out().print(t)


@documents_app.command("get")
def documents_get(bank: str, document_id: str, as_json: bool = typer.Option(False, "--json"),
                  text: bool = typer.Option(True, "--text/--no-text",
                                            help="print the original text"),
                  address: str = AddressOpt):
    """Show one document: its original text (when the bank stores documents), its
    history of retains and its memories in item order."""
    with _session(address) as m:
        d = m.get_document(bank, document_id)
    if as_json:
        return _print_json(d)

    def iso(ts) -> str:
        return (ts.ToDatetime(timezone.utc).isoformat(timespec="seconds")
                if ts.seconds or ts.nanos else "unknown")
    out = _out()
    created = iso(d.create_time) if d.HasField("create_time") else "unknown"
    updated = iso(d.update_time) if d.HasField("update_time") else "unknown"
    out.print(f"{d.document_id}: {d.memory_count} memories, {d.revision_count} revisions, "
              f"created {created}, last retained {updated}")
    if d.content_hash:
        out.print(f"text: {d.content_chars} characters, sha256 {d.content_hash}, "
                  f"{'stored' if d.text_stored else 'not stored'}")
    if text and d.original_text:
        print(d.original_text)  # as stored: never rewrapped to the terminal's width
    for r in d.history:  # one line each: full operation names, never cut
        tags = f", tags {', '.join(r.tags)}" if r.tags else ""
        # no hash: a later retain replaced it (or it was deleted), its text erased
        size = f"{r.content_chars} chars" if r.content_hash else "text erased"
        out.print(f"  revision {r.revision}  {iso(r.retain_time)}  {r.operation}  "
                  f"{r.item_count} item(s), {size}{tags}", soft_wrap=True)
    from mneme.v1 import resources_pb2
    t = _table("memory", "type", "text", ids=("memory",))
    for mem in d.memories:
        t.add_row(mem.id, resources_pb2.FactType.Name(mem.fact_type).lower(), mem.text)
    out.print(t)


@documents_app.command("delete")
def documents_delete(bank: str, document_id: str, address: str = AddressOpt):
    """Delete one document: its memories, its text and history (erased, also on the log)."""
    with _session(address) as m:
        op = m.delete_document(bank, document_id)
    _ended(op, f"deleted document {document_id}")


tags_app = typer.Typer(rich_markup_mode="markdown", help="The tags on a bank's memories.", no_args_is_help=True)
app.add_typer(tags_app, name="tags")


@tags_app.command("list")
def tags_list(bank: str, limit: int = typer.Option(0, min=0, help="at most this many (0: all)"),
              as_json: bool = typer.Option(False, "--json"), address: str = AddressOpt):
    """List the tags on BANK's memories in tag order with how many memories carry each."""
    with _client(address) as m:
        tags = _listed(m.list_tags(bank), limit)
    if as_json:
        return _print_json(tags)
    t = _table("tag", "memories")
    for tag in tags:
        t.add_row(tag.tag, str(tag.memory_count))
    _out().print(t)


operations_app = typer.Typer(rich_markup_mode="markdown", help="Long-running work (retains, deletions, consolidations).")
app.add_typer(operations_app, name="operations")


@operations_app.callback(invoke_without_command=True)
def operations(ctx: typer.Context,
               bank: Optional[str] = typer.Option(None, "--bank", "-b",
                                                  help="one bank; default every bank"),
               limit: int = typer.Option(50, min=0, help="at most this many"),
               filter_: str = typer.Option("", "--filter", help='only these, e.g. '
                                           '\'state = "FAILED" AND kind = "retain"\' '
                                           '(fields state and kind, joined by AND)'),
               as_json: bool = typer.Option(False, "--json"), address: str = AddressOpt):
    """List operations (retains, deletions, …) with their status and progress; the
    commands below get, cancel and retry one."""
    if ctx.invoked_subcommand is not None:
        return
    with _session(address) as m:
        ops = _listed(m.list_operations(bank or "", filter=filter_), limit)
    if as_json:
        return _print_json(ops)
    t = _table("operation", "bank", "kind", "state", "items", "facts", "updated", "error",
               ids=("operation",))
    for op in ops:
        t.add_row(op.name.split("/", 1)[-1], op.bank_id, op.kind, _op_state(op),
                  f"{op.items_done}/{op.items_total}", str(op.facts),
                  op.update_time.ToDatetime(timezone.utc).isoformat(timespec="seconds"),
                  op.error)
    _out().print(t)


def _op_state(op) -> str:
    """The state, with "cancelled" / "cancelling" / "retry of …" noted."""
    state = _state(op.state)
    if op.cancelled:
        state += " (cancelled)"
    elif op.cancel_requested and state not in ("succeeded", "failed"):
        state += " (cancelling)"
    return state


def _print_operation(op, as_json: bool) -> None:
    if as_json:
        return _print_json(op)
    print(f"{op.name}  {op.kind}  {_op_state(op)}  bank {op.bank_id}")
    print(f"  items {op.items_done}/{op.items_total}, facts {op.facts}")
    if op.retry_of:
        print(f"  retry of {op.retry_of}")
    if op.error:
        print(f"  error: {op.error}")
    for e in op.item_errors:
        print(f"  items[{e.item_index}]: {e.error}")


def _operation_call(name: str, call: str, as_json: bool, address: str) -> None:
    with _session(address) as m:
        op = getattr(m, call)(name)
    _print_operation(op, as_json)


@operations_app.command("get")
def operations_get(name: str = typer.Argument(..., help="operations/{id} or the id"),
                   as_json: bool = typer.Option(False, "--json"), address: str = AddressOpt):
    """Show one operation: state, progress, item errors, what it retries."""
    _operation_call(name, "get_operation", as_json, address)


@operations_app.command("cancel")
def operations_cancel(name: str = typer.Argument(..., help="operations/{id} or the id"),
                      as_json: bool = typer.Option(False, "--json"), address: str = AddressOpt):
    """Cancel a pending or running retain.

    Extraction stops before its next item, what was stored stays, and the operation ends
    failed (cancelled). Refused for an operation that has ended or is not a retain."""
    _operation_call(name, "cancel_operation", as_json, address)


@operations_app.command("retry")
def operations_retry(name: str = typer.Argument(..., help="operations/{id} or the id"),
                     as_json: bool = typer.Option(False, "--json"), address: str = AddressOpt):
    """Run a retain's failed items again as a new operation.

    The items in its item errors (a cancelled retain's unprocessed ones included; every
    item when it failed as a whole) go again with their documents' other items; the new
    operation's retry_of names NAME. Refused while it runs or when nothing failed."""
    _operation_call(name, "retry_operation", as_json, address)


def _bank_profile(bank_id: str, as_json: bool, address: str) -> None:
    with _session(address) as m:
        p = m.bank_profile(bank_id)
    if as_json:
        return _print_json(p)
    c, s = p.bank.config, p.stats
    print(f"{bank_id}  {p.bank.display_name}")
    print(f"  last activity: {p.last_activity_time.ToDatetime(timezone.utc).isoformat()}")
    print(f"  traits: skepticism {c.skepticism}, literalism {c.literalism}, empathy {c.empathy}")
    for label, text in (("retain mission", c.retain_mission),
                        ("observations mission", c.observations_mission),
                        ("reflect mission", c.reflect_mission)):
        if text:
            print(f"  {label}: {text}")
    print(f"  facts {s.facts}, observations {s.observations}, entities {s.entities}, "
          f"documents {p.documents}, directives {p.directives}, mental models "
          f"{p.mental_models}, operations {s.operations} ({s.pending_operations} pending)")


def _bank_stats(bank_id: str, address: str) -> None:
    with _session(address) as m:
        s = m.bank_stats(bank_id)
    known = lambda n: str(n) if n >= 0 else "n/a (not on this server, or its store does not answer)"  # noqa: E731
    print(f"bank {bank_id}")
    print(f"  facts         {known(s.facts)}")
    print(f"  observations  {known(s.observations)}")
    print(f"  entities      {known(s.entities)}")
    print(f"  operations    {s.operations} ({s.pending_operations} pending)")
    pending = (s.pending_records if s.pending_records >= 0
               else "n/a (not shown to a key limited to some banks)")
    print(f"  pending records (consumer lag on the bank's partition): {pending}")
    for lag in s.lag:
        print(f"    {lag.group:<15} {lag.topic}[{lag.partition}]  {lag.lag}")


topics_app = typer.Typer(rich_markup_mode="markdown", help="The event log's topics.", no_args_is_help=True)
app.add_typer(topics_app, name="topics")


@topics_app.command("create")
def topics_create():
    """Create every mneme topic on the event log of MNEME_BUS_URL that is missing, with
    its partitions (MNEME_PARTITIONS), replication (MNEME_KAFKA_REPLICATION_FACTOR) and
    configs (history never expires, the key topic is compacted), then check them (as
    `mneme topics check`). Existing
    topics are left alone. Used by the Helm chart's topics Job."""
    from mneme.bus import ALL_TOPICS, MANAGED_TOPICS
    from mneme.bus.logs import open_event_log
    from mneme.bus.topics import ensure
    from mneme.config import Settings
    st = Settings()
    event_log = open_event_log(st.url("bus"), **st.kafka_options())
    try:
        # the key topic only on Kafka: the embedded topology keeps its keys in keys.db
        kafka = st.url("bus").lower().startswith("kafka:")
        ensure(event_log, st.topic_partitions(), keys=kafka)
        for t in MANAGED_TOPICS if kafka else ALL_TOPICS:
            print(f"{t}\t{event_log.partitions(t)} partitions")
        _report_topics(event_log, st.partitions)
    finally:
        event_log.close()


@topics_app.command("check")
def topics_check():
    """Check the topics of MNEME_BUS_URL: exit 1 when a history topic (intake, memory)
    would lose records (finite retention, or compaction), so that replay from offset 0
    could not rebuild the projections, or when a bank-keyed topic's partition count is not
    MNEME_PARTITIONS or changed after records were written; other configs that differ
    are warnings."""
    from mneme.bus.logs import open_event_log
    from mneme.config import Settings
    st = Settings()
    event_log = open_event_log(st.url("bus"), **st.kafka_options())
    try:
        _report_topics(event_log, st.partitions)
    finally:
        event_log.close()


def _report_topics(event_log, partitions: int | None) -> None:
    from mneme.bus.topics import check
    report = check(event_log, partitions)
    for w in report.warnings:
        console.print(f"warning {w}", style="yellow")
    for e in report.errors:
        console.print(f"error {e}", style="red")
    if report.errors:
        raise typer.Exit(1)
    console.print("topics ok")


log_app = typer.Typer(rich_markup_mode="markdown", help="The embedded event log (log.db): check and recover.",
                      no_args_is_help=True)
app.add_typer(log_app, name="log")


@log_app.command("recover")
def log_recover(data_dir: Path = typer.Option(None, "--data-dir", "-d",
                                              help="default: $MNEME_DATA_DIR or ./.mneme")):
    """Rebuild a damaged embedded event log (MNEME_BUS_URL=sqlite:///…, default
    DATA_DIR/log.db) from every record SQLite can still read, keeping topics, partitions,
    offsets and consumer-group offsets; the damaged file is kept beside it
    (log.db.damaged-<time>). A log found whole is left as it is; an interrupted recovery
    leaves the log as it was. Stop the server first. Then `mneme replay` rebuilds the
    projections from what was kept."""
    from mneme.bootstrap import Root
    from mneme.datadir import DataDirLocked
    from mneme.bus.sqlite_log import recover

    settings = _settings_of(data_dir, embedded_log_only=True)
    url = settings.url("bus")
    if not url.lower().startswith("sqlite:"):
        console.print(f"{url} is not an embedded (sqlite) log", style="red")
        raise typer.Exit(2)
    try:
        root = Root(settings)  # the data dir lock: no server may use the log meanwhile
    except DataDirLocked as e:
        console.print(f"{e}", style="red")
        raise typer.Exit(1)
    try:
        path = url.split("://", 1)[1]
        path = path[1:] if path.startswith("//") else path
        if not os.path.exists(path):
            console.print(f"no event log at {path}", style="red")
            raise typer.Exit(1)
        r = recover(path)
    finally:
        root.close()
    if r.problem is None:
        print(f"checked {path}: no damage found; the log is left as it is")
        return
    print(f"checked {path}: {r.problem}")
    print(f"kept {r.kept_total} records, {r.groups} consumer-group offsets"
          + (" (group offsets unreadable: groups start from 0)" if r.groups_lost else ""))
    for topic, n in sorted(r.kept.items()):
        lost = r.lost.get(topic, 0)
        print(f"  {topic:<20} kept {n}" + (f", lost {lost} (gaps)" if lost else ""))
    print(f"lost {r.lost_total} records found missing between kept ones"
          f" ({r.unreadable_rows} unreadable rows); records after the last readable one "
          "cannot be counted")
    print(f"the damaged file is kept at {r.damaged}")
    print("next: `mneme replay` rebuilds the projections from the recovered log (with "
          "--force when records were lost: the live stores then hold more than the log)")


dlq_app = typer.Typer(rich_markup_mode="markdown", help="The dead-letter topic (mneme.dlq.v1): inspect and re-publish.",
                      no_args_is_help=True)
app.add_typer(dlq_app, name="dlq")


def _dlq_records(event_log, start: int = 0):
    from mneme.bus import DLQ
    for p in range(event_log.partitions(DLQ)):
        offset = start
        while True:
            batch = event_log.read(DLQ, p, offset, 100)
            if not batch:
                break
            yield from batch
            offset = batch[-1].offset + 1


@dlq_app.command("list")
def dlq_list(start: int = typer.Option(0, min=0, help="first DLQ offset")):
    """Dead letters on MNEME_BUS_URL: offset, source topic/partition/offset, group, error."""
    from mneme.bootstrap import Root
    root = Root()
    try:
        t = Table("offset", "bank", "type", "from", "group", "attempts", "error")
        for r in _dlq_records(root.log, start):
            h = dict(r.headers)
            t.add_row(str(r.offset), r.key, h.get("ce_type", ""),
                      f"{h.get('dlq_topic')}[{h.get('dlq_partition')}]@{h.get('dlq_offset')}",
                      h.get("dlq_group", ""), h.get("dlq_attempts", ""), h.get("dlq_error", ""))
        _out().print(t)
    finally:
        root.close()


@dlq_app.command("replay")
def dlq_replay(offset: List[int] = typer.Option([], "--offset", help="DLQ offsets; default all from --start"),
               start: int = typer.Option(0, min=0, help="first DLQ offset"),
               dry_run: bool = typer.Option(False, "--dry-run")):
    """Re-publish dead letters to the topic they came from (dlq_* headers removed, the
    CloudEvents headers and payload unchanged). Every group on that topic sees them again;
    handlers are idempotent (deterministic ids), so that is safe. Fix the cause first."""
    from mneme.bootstrap import Root
    from mneme.bus.dead_letter import VALUE_OMITTED
    from mneme.ports import OutRecord
    root = Root()
    try:
        out = []
        for r in _dlq_records(root.log, start):
            if offset and r.offset not in offset:
                continue
            h = {k: v for k, v in dict(r.headers).items() if not k.startswith("dlq_")}
            topic = dict(r.headers).get("dlq_topic")
            if not topic:
                continue
            value = bytes(r.value)
            if VALUE_OMITTED in r.headers:  # too large to copy: the original's value
                original = root.log.read(topic, int(r.headers["dlq_partition"]),
                                         int(r.headers["dlq_offset"]), 1)
                if not original or original[0].offset != int(r.headers["dlq_offset"]):
                    print(f"dlq@{r.offset}: its original {topic}[{r.headers['dlq_partition']}]"
                          f"@{r.headers['dlq_offset']} is gone; skipped")
                    continue
                value = bytes(original[0].value)
            out.append(OutRecord(topic=topic, key=r.key, value=value, headers=h))
            print(f"dlq@{r.offset} → {topic} ({h.get('ce_type', '?')}, bank {r.key})")
        if out and not dry_run:
            root.log.append(out)
        results.print(f"{'would re-publish' if dry_run else 're-published'} {len(out)} records")
    finally:
        root.close()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
