"""A grpcio client of shop.v1.Orders/CreateOrder, driven by tests/interop.rs.

Prints one JSON line per call on stdout:
    {"call": 1, "code": "OK", "code_value": 0, "details": "", "initial": {...}, "trailing": {...},
     "order": {"order_id": ..., ...} | null}
where `initial` / `trailing` map each metadata key to its list of values (binary values
as hex), so the caller can check `x-idempotency-replayed` wherever the server put it.

Modes:
  twice      the same request twice with the same key (expect one execution, a replay);
  different  a request, then a different one (quantity + 1) with the same key;
  retry      one call on a channel whose service config makes grpcio itself retry
             (retryPolicy, maxAttempts --max-attempts, on UNAVAILABLE).

--service-config FILE gives the channel that service config instead (in any mode), with
retries enabled: the very file idem's server reads, idem's own objects included, which
grpcio must accept and ignore.

Without --key no `x-idempotency-key` is sent. --compression gzip compresses every
request message, `first` only the first call's (to check that a server fingerprints
requests after decompression).

Exit status: 0 when every call got a status (whatever it was), 2 on a usage error.
"""

import argparse
import json
import sys

import grpc

from shop_stubs import emit, load, metadata_to_dict


def retry_service_config(max_attempts):
    """gRFC A6 retry policy for every method of shop.v1.Orders."""
    return json.dumps(
        {
            "methodConfig": [
                {
                    "name": [{"service": "shop.v1.Orders"}],
                    "retryPolicy": {
                        "maxAttempts": max_attempts,
                        "initialBackoff": "0.05s",
                        "maxBackoff": "0.2s",
                        "backoffMultiplier": 2,
                        "retryableStatusCodes": ["UNAVAILABLE"],
                    },
                }
            ]
        }
    )


def order_to_dict(order):
    return {
        "order_id": order.order_id,
        "customer_id": order.customer_id,
        "sku": order.sku,
        "quantity": order.quantity,
        "created_by": order.created_by,
    }


def call_create(stub, request, key, timeout, n, gzip):
    metadata = [("x-idempotency-key", key)] if key is not None else []
    compression = grpc.Compression.Gzip if gzip else grpc.Compression.NoCompression
    try:
        order, call = stub.CreateOrder.with_call(
            request, metadata=metadata, timeout=timeout, compression=compression
        )
        emit_call(n, call, order)
    except grpc.RpcError as err:
        # A failed unary call's RpcError is also its grpc.Call.
        emit_call(n, err, None)


def emit_call(n, call, order):
    """Prints call `n`'s line: its status and metadata, and `order` (None on failure)."""
    emit(
        call=n,
        code=call.code().name,
        code_value=call.code().value[0],
        details=call.details() or "",
        initial=metadata_to_dict(call.initial_metadata()),
        trailing=metadata_to_dict(call.trailing_metadata()),
        order=order_to_dict(order) if order is not None else None,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--addr", required=True, help="host:port of the server")
    parser.add_argument("--mode", required=True, choices=["twice", "different", "retry"])
    parser.add_argument("--key", help="x-idempotency-key value (none sent when absent)")
    parser.add_argument("--customer", default="c-1")
    parser.add_argument("--sku", default="sku-1")
    parser.add_argument("--quantity", type=int, default=1)
    parser.add_argument("--note", default="")
    parser.add_argument("--max-attempts", type=int, default=4, help="retry mode: retryPolicy.maxAttempts")
    parser.add_argument("--compression", default="none", choices=["none", "gzip", "first"])
    parser.add_argument("--service-config", help="service config JSON file for the channel")
    parser.add_argument("--timeout", type=float, default=10.0, help="per-call deadline, seconds")
    parser.add_argument("--proto-root", help="directory holding shop/v1/orders.proto")
    args = parser.parse_args()

    pb2, pb2_grpc = load(args.proto_root)
    options = []
    if args.service_config:
        with open(args.service_config, encoding="utf-8") as f:
            options = [("grpc.enable_retries", 1), ("grpc.service_config", f.read())]
    elif args.mode == "retry":
        options = [
            ("grpc.enable_retries", 1),
            ("grpc.service_config", retry_service_config(args.max_attempts)),
        ]
    request = pb2.CreateOrderRequest(
        customer_id=args.customer, sku=args.sku, quantity=args.quantity, note=args.note
    )
    with grpc.insecure_channel(args.addr, options=options) as channel:
        stub = pb2_grpc.OrdersStub(channel)

        def call(req, n):
            gzip = args.compression == "gzip" or (args.compression == "first" and n == 1)
            call_create(stub, req, args.key, args.timeout, n, gzip)

        if args.mode == "twice":
            call(request, 1)
            call(request, 2)
        elif args.mode == "different":
            call(request, 1)
            other = pb2.CreateOrderRequest()
            other.CopyFrom(request)
            other.quantity = request.quantity + 1
            call(other, 2)
        else:
            call(request, 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
