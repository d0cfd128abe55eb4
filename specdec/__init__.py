"""specdec: speculative decoding served as three gRPC services (gateway, draft, target)."""
