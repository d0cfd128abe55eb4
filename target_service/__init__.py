"""The target service: serves the large model's prefill and verify over gRPC."""
import specdec  # noqa: F401 - first: it picks gRPC's poller before any of our modules loads grpc
