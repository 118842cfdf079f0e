"""The ``mneme`` command line.

``mneme up`` runs every service in one process on the embedded stores; the other
commands are gRPC clients of a running server (``--address``, or ``MNEME_ADDRESS``),
except ``replay``, which rebuilds the projections of a stopped server's data dir.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import List, Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import grpc  # noqa: E402
import typer  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,  # noqa: E402
                           TimeElapsedColumn, TimeRemainingColumn)
from rich.table import Table  # noqa: E402

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="mneme: long-term memory for AI agents.")
console = Console(stderr=True)
ADDRESS = os.environ.get("MNEME_ADDRESS", "127.0.0.1:50051")
AddressOpt = typer.Option(ADDRESS, "--address", "-a", help="gRPC address of a running server")


def _client(address: str):
    from mneme.client import MnemeClient
    return MnemeClient(address)


def _fail(e: grpc.RpcError) -> None:
    from mneme.client import field_violations
    console.print(f"[red]{e.code().name}[/red]: {e.details()}")
    for f, d in field_violations(e):
        console.print(f"  {f}: {d}")
    raise typer.Exit(2)


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TimeRemainingColumn(), console=console)


@app.command()
def up(data_dir: Path = typer.Option(None, "--data-dir", "-d", help="default: $MNEME_DATA_DIR or ./.mneme"),
       address: str = typer.Option(None, "--address", "-a", help="listen address, default 127.0.0.1:50051")):
    """Serve every API (ingest, search, reflect, health, reflection) on one port, with
    every service running in this process on the embedded stores."""
    from mneme.bootstrap import DataDirLocked, bootstrap
    from mneme.config import Settings

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = {}
    if data_dir:
        overrides["data_dir"] = data_dir
    if address:
        overrides["grpc_address"] = address
    settings = Settings(**overrides)
    try:
        node = bootstrap(settings)
    except DataDirLocked as e:
        console.print(f"[red]{e}[/red]")
        raise typer.Exit(1)
    node.start()
    port = node.serve()
    host = settings.grpc_address.rsplit(":", 1)[0]
    console.print(f"mneme is up on {host}:{port} (data in {settings.data_dir.resolve()}); "
                  "no authentication: loopback use only. Ctrl-C stops it.")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
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
    from mneme.bootstrap import SERVICES, run_service
    from mneme.config import Settings

    if service not in SERVICES:
        console.print(f"[red]unknown service {service!r}[/red]; one of {', '.join(SERVICES)}")
        raise typer.Exit(2)
    logging.basicConfig(level=os.environ.get("MNEME_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s")
    overrides = {}
    if data_dir:
        overrides["data_dir"] = data_dir
    if address:
        overrides["grpc_address"] = address
    run_service(service, Settings(**overrides))


@app.command()
def banks(action: str = typer.Argument("list", help="list | create | get | delete | check-llm"),
          bank_id: Optional[str] = typer.Argument(None), address: str = AddressOpt):
    """List, create, show or delete banks, or check the language models a bank uses."""
    with _client(address) as m:
        try:
            if action == "list":
                t = Table("bank", "display name", "created")
                for b in m.list_banks():
                    t.add_row(b.name.split("/", 1)[1], b.display_name,
                              b.create_time.ToDatetime().isoformat(timespec="seconds"))
                Console().print(t)
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
            elif action in ("create", "get", "delete") and bank_id:
                b = {"create": m.upsert_bank, "get": m.get_bank}.get(action, m.delete_bank)(bank_id)
                print(b if b is not None else f"deleted {bank_id}")
            else:
                console.print("usage: mneme banks [list | create ID | get ID | delete ID | check-llm ID]")
                raise typer.Exit(2)
        except grpc.RpcError as e:
            _fail(e)


@app.command()
def retain(bank: str, content: str = typer.Argument(..., help="text, or - to read stdin"),
           context: str = "", document_id: str = "", tag: List[str] = typer.Option([], "--tag"),
           timestamp: Optional[datetime] = typer.Option(None, help="when it happened (ISO 8601)"),
           async_: bool = typer.Option(False, "--async"), address: str = AddressOpt):
    """Retain one item into BANK (the bank is created if missing)."""
    text = sys.stdin.read() if content == "-" else content
    ts = timestamp.replace(tzinfo=timestamp.tzinfo or timezone.utc) if timestamp else None
    with _client(address) as m:
        try:
            m.upsert_bank(bank) if not _exists(m, bank) else None
            r = m.retain(bank, [{"content": text, "context": context, "document_id": document_id,
                                 "tags": tag, "timestamp": ts}], async_=async_)
        except grpc.RpcError as e:
            _fail(e)
    op = r.operation
    print(f"{op.name}: {op.kind} {_state(op.state)}, {op.facts} facts")
    for mid in r.memory_ids:
        print(f"  {mid}")


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


@app.command()
def recall(bank: str, query: str, max_tokens: int = 1024, budget: str = "mid",
           tag: List[str] = typer.Option([], "--tag"), tags_match: str = "any",
           as_json: bool = typer.Option(False, "--json"), address: str = AddressOpt):
    """Recall the memories of BANK that matter for QUERY, with each arm's rank."""
    with _client(address) as m:
        try:
            r = m.recall(bank, query, max_tokens=max_tokens, budget=budget, tags=tag,
                         tags_match=tags_match)
        except grpc.RpcError as e:
            _fail(e)
    if as_json:
        from google.protobuf.json_format import MessageToDict
        print(json.dumps(MessageToDict(r), indent=1))
        return
    print_recall(r)


def print_recall(r, limit: int | None = None) -> None:
    """Print recall results as a table (text, date, per-arm ranks)."""
    t = Table("#", "memory", "date", "sem", "bm25", "graph", "time", show_lines=False)
    for n, res in enumerate(r.results[:limit] if limit else r.results, 1):
        mem, s = res.memory, res.scores
        when = (mem.occurred_start if mem.HasField("occurred_start") else mem.mentioned_at)
        rank = lambda x: str(x) if x else "-"  # noqa: E731
        t.add_row(str(n), mem.text, when.ToDatetime().strftime("%Y-%m-%d"), rank(s.semantic_rank),
                  rank(s.keyword_rank), rank(s.graph_rank), rank(s.temporal_rank))
    Console().print(t)


@app.command()
def reflect(bank: str, query: str, context: str = "", budget: str = "mid", address: str = AddressOpt):
    """Answer QUERY by reasoning over BANK (extractive without a language model)."""
    with _client(address) as m:
        try:
            r = m.reflect(bank, query, context=context, budget=budget)
        except grpc.RpcError as e:
            _fail(e)
    print(r.text)
    print(f"based on: {', '.join(r.based_on)}")


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
    with _client(address) as m, _progress() as prog:
        for c in convs:
            bank_id = bank or c["sample_id"]
            sessions = locomo.sessions(c)
            task = prog.add_task(f"{c['sample_id']} → banks/{bank_id}",
                                 total=sum(len(s.items) for s in sessions))
            try:
                m.upsert_bank(bank_id, display_name=f"LoCoMo {c['sample_id']}")
                for s in sessions:
                    m.retain(bank_id, s.items)
                    prog.advance(task, len(s.items))
            except grpc.RpcError as e:
                _fail(e)


@app.command("replay")
def replay_cmd(data_dir: Path = typer.Option(None, "--data-dir", "-d")):
    """Rebuild every projection (vectors, text, graph, catalog) from the event log of a
    stopped server's data dir. Calls no model: derived events carry facts and vectors.
    With MNEME_BUS_URL=kafka://… (distributed), rebuilds the search service's
    projections and rewinds its consumer groups; stop the search processes first."""
    from mneme.bootstrap import DataDirLocked, replay
    from mneme.bus import StaleCommitError
    from mneme.config import Settings

    settings = Settings(**({"data_dir": data_dir} if data_dir else {}))
    with _progress() as prog:
        task = prog.add_task("replaying the log", total=None)

        def progress(done: int, total: int) -> None:
            prog.update(task, completed=done, total=total)
        try:
            stats = replay(settings, progress)
        except DataDirLocked as e:
            console.print(f"[red]{e}[/red]")
            raise typer.Exit(1)
        except StaleCommitError as e:  # Kafka: the search group still has members
            console.print(f"[red]stop the search processes first: {e}[/red]")
            raise typer.Exit(1)
    console.print(f"replayed {stats['records']} records")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
