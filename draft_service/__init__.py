"""The draft service: proposes draft tokens over gRPC (a small LM, or n-gram lookup)."""
