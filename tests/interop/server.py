"""A grpcio shop.v1.Orders server that fails the first N CreateOrder attempts, driven by
tests/interop.rs.

Prints JSON lines on stdout:
    {"event": "listening", "port": P}                       once, when it serves
    {"event": "attempt", "n": 1, "key": "...", "previous_rpc_attempts": "1" | null,
     "outcome": "UNAVAILABLE" | "OK", "metadata": {...}}     per CreateOrder attempt
The attempt line is flushed before the reply is sent, so by the time a client sees a reply
its line is already in the pipe.

With --pushback-ms V each failure carries `grpc-retry-pushback-ms: V` (gRFC A6 server
pushback; negative means "do not retry").

It exits when its standard input reaches end of file (the parent went away) or after
--max-lifetime seconds, so a crashed test never leaves it running.
"""

import argparse
import concurrent.futures
import sys
import threading

import grpc

from shop_stubs import emit, load, metadata_to_dict


def make_servicer(pb2, pb2_grpc, fail_first, fail_code, pushback_ms):
    class Orders(pb2_grpc.OrdersServicer):
        def __init__(self):
            self._lock = threading.Lock()
            self._attempts = 0
            self._orders = 0

        def CreateOrder(self, request, context):
            metadata = dict()
            for item in context.invocation_metadata():
                metadata.setdefault(item.key, []).append(item.value)
            with self._lock:
                self._attempts += 1
                n = self._attempts
                fail = n <= fail_first
                if not fail:
                    self._orders += 1
                    order_id = f"py-{self._orders}"
            key = metadata.get("x-idempotency-key")
            previous = metadata.get("grpc-previous-rpc-attempts")
            emit(
                event="attempt",
                n=n,
                key=key[0] if key and len(key) == 1 else key,
                previous_rpc_attempts=previous[0] if previous else None,
                outcome=fail_code.name if fail else "OK",
                metadata=metadata_to_dict(context.invocation_metadata()),
            )
            if fail:
                if pushback_ms is not None:
                    context.set_trailing_metadata((("grpc-retry-pushback-ms", pushback_ms),))
                # No message and no initial metadata sent: C-core answers Trailers-Only,
                # which a gRFC A6 client may retry.
                context.abort(fail_code, f"injected failure {n} of {fail_first}")
            return pb2.Order(
                order_id=order_id,
                customer_id=request.customer_id,
                sku=request.sku,
                quantity=request.quantity,
                created_by="grpcio",
            )

    return Orders()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--fail-first", type=int, default=2, help="CreateOrder attempts to fail")
    parser.add_argument("--fail-code", default="UNAVAILABLE", help="status code name of the failures")
    parser.add_argument("--pushback-ms", help="grpc-retry-pushback-ms sent with each failure")
    parser.add_argument("--max-lifetime", type=float, default=120.0, help="seconds before it exits anyway")
    parser.add_argument("--proto-root", help="directory holding shop/v1/orders.proto")
    args = parser.parse_args()

    try:
        fail_code = grpc.StatusCode[args.fail_code.upper()]
    except KeyError:
        parser.error(f"unknown status code {args.fail_code!r}")

    pb2, pb2_grpc = load(args.proto_root)
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=4))
    pb2_grpc.add_OrdersServicer_to_server(make_servicer(pb2, pb2_grpc, args.fail_first, fail_code, args.pushback_ms), server)
    port = server.add_insecure_port(f"127.0.0.1:{args.port}")
    if port == 0:
        raise SystemExit(f"could not bind 127.0.0.1:{args.port}")
    server.start()
    emit(event="listening", port=port)

    done = threading.Event()

    def watch_stdin():
        # Returns at end of file: the parent closed the pipe or died.
        for _ in sys.stdin:
            pass
        done.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    done.wait(timeout=args.max_lifetime)
    server.stop(grace=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
