"""specdec: speculative decoding served as three gRPC services (gateway, draft, target).

gRPC's I/O: the legacy poller, not its EventEngine, unless GRPC_EXPERIMENTS says otherwise
(`GRPC_EXPERIMENTS=` keeps gRPC's own default). With the EventEngine, a message that arrives wakes
an engine thread, which hands it to the thread that polls the completion queue for grpc.aio; the
legacy poller reads the socket on that thread itself, one thread wake-up fewer per message. On the
H200 host a bare grpc.aio ping-pong fell from 199 to 97 µs with it, and a round trip after 4.5 ms
of handler work from 858 to 427 µs (`bench/grpc_pingpong.py`, bench/results/grpc_pingpong_poller.json):
a speculative step makes two. gRPC reads the variable once, when it loads: so it is set here,
which every module of ours that imports grpc runs first (the services' packages import this one).
"""
import os

LEGACY_POLLER = "-event_engine_client,-event_engine_listener"
os.environ.setdefault("GRPC_EXPERIMENTS", LEGACY_POLLER)
