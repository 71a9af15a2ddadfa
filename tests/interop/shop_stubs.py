"""Generates and imports the grpcio stubs of proto/shop/v1/orders.proto.

The stubs are generated at run time with grpcio-tools' bundled protoc into a temporary
directory (nothing generated is committed), imported, and the directory is removed: once
imported, the modules no longer need their files.

Usage:
    from shop_stubs import load
    pb2, pb2_grpc = load()            # proto root defaults to <repo>/proto
"""

import importlib
import pathlib
import subprocess
import sys
import tempfile

DEFAULT_PROTO_ROOT = pathlib.Path(__file__).resolve().parents[2] / "proto"
PROTO_FILE = "shop/v1/orders.proto"


def load(proto_root=None):
    """Returns the `orders_pb2` and `orders_pb2_grpc` modules, freshly generated."""
    root = pathlib.Path(proto_root) if proto_root else DEFAULT_PROTO_ROOT
    with tempfile.TemporaryDirectory(prefix="idem-interop-stubs-") as out:
        cmd = [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{root}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            PROTO_FILE,
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise SystemExit(f"protoc failed ({done.returncode}): {done.stderr.strip()}")
        # The generated code imports `shop.v1.orders_pb2`: `shop` and `shop.v1` are
        # namespace packages rooted in the temporary directory.
        sys.path.insert(0, out)
        try:
            pb2 = importlib.import_module("shop.v1.orders_pb2")
            pb2_grpc = importlib.import_module("shop.v1.orders_pb2_grpc")
        finally:
            sys.path.remove(out)
    return pb2, pb2_grpc


def metadata_to_dict(metadata):
    """Metadata pairs as a JSON-friendly dict: key -> list of values (binary values as hex)."""
    out = {}
    for key, value in metadata or ():
        if isinstance(value, bytes):
            value = value.hex()
        out.setdefault(key, []).append(value)
    return out


def emit(**fields):
    """Prints one JSON line on stdout and flushes it, so a reading parent sees it at once."""
    import json

    print(json.dumps(fields, sort_keys=True), flush=True)
