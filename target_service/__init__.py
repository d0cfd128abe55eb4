"""The target service: serves the large model's prefill and verify over gRPC."""
