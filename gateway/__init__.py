"""The gateway: the public Generate RPC and the speculative decoding loop."""
import specdec  # noqa: F401 - first: it picks gRPC's poller before any of our modules loads grpc
