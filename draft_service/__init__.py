"""The draft service: proposes draft tokens over gRPC (a small LM, or n-gram lookup)."""
import specdec  # noqa: F401 - first: it picks gRPC's poller before any of our modules loads grpc
