"""The model runtime shared by the draft and target services.

Model loading, a compact Llama-family model over a paged KV cache, batched forwards, greedy
verification and the batching loop. Nothing here knows about gRPC or about speculation's
control flow: the services expose generic verbs (prefill, propose, verify, release).
"""
