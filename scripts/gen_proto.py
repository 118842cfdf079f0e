"""Generate Python protobuf and gRPC code from proto/ into OUT (default: libs).

Usage: python scripts/gen_proto.py [OUT]. Output is deterministic for a given
grpcio-tools version, so regenerating gives byte-identical files.
"""

import pathlib
import sys

import grpc_tools
from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent


def main(out: str = "libs") -> int:
    out_dir = (ROOT / out).resolve()
    protos = sorted(str(p.relative_to(ROOT / "proto")) for p in (ROOT / "proto").rglob("*.proto"))
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = ["protoc", f"-I{ROOT / 'proto'}", f"-I{include}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *protos]
    rc = protoc.main(args)
    if rc != 0:
        return rc
    for pkg in {pathlib.Path(p).parent for p in protos}:
        d = out_dir / pkg
        while d != out_dir / "mneme" and d != out_dir:
            (d / "__init__.py").touch()
            d = d.parent
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
