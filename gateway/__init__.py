"""The gateway: the public Generate RPC and the speculative decoding loop."""
