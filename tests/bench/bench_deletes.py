"""Deletion throughput of the embedded topology (a real ``mneme up``): a bank of
``--facts`` one-fact documents, then ``--sequential`` sync DeleteDocument calls one after
another, then ``--bulk`` more from ``--threads`` client threads at once. Prints the
wall-clock seconds of each phase (every call returns once its deletion is done: since
deletions are physical, once the stores have purged it).

    PYTHONPATH=libs:. .venv/bin/python tests/bench/bench_deletes.py [--facts 300]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mneme.v1 import operations_pb2
from tests.e2e.server import Server


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--facts", type=int, default=300)
    ap.add_argument("--sequential", type=int, default=50)
    ap.add_argument("--bulk", type=int, default=200)
    ap.add_argument("--threads", type=int, default=20)
    a = ap.parse_args()
    if a.sequential + a.bulk > a.facts:
        ap.error("--sequential + --bulk must not exceed --facts")
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(Path(tmp) / "data").start()
        try:
            with server.client(timeout=600) as m:
                m.upsert_bank("bench")
                t = time.monotonic()
                for i in range(0, a.facts, 50):
                    m.retain("bench", [{"content": f"Person {j} keeps {j} bees in town {j % 17}.",
                                        "document_id": f"d{j}"}
                                       for j in range(i, min(a.facts, i + 50))])
                print(f"retain {a.facts} facts: {time.monotonic() - t:.1f} s")
                t = time.monotonic()
                for j in range(a.sequential):
                    assert m.delete_document("bench", f"d{j}").state == operations_pb2.SUCCEEDED
                print(f"{a.sequential} sequential DeleteDocument: {time.monotonic() - t:.1f} s")
                docs = [f"d{j}" for j in range(a.sequential, a.sequential + a.bulk)]
                t = time.monotonic()
                with ThreadPoolExecutor(a.threads) as pool:
                    states = list(pool.map(lambda d: m.delete_document("bench", d).state, docs))
                assert all(s == operations_pb2.SUCCEEDED for s in states)
                print(f"{a.bulk} DeleteDocument from {a.threads} threads: "
                      f"{time.monotonic() - t:.1f} s")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
