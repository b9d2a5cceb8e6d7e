"""sglang-evict: decode-time KV-cache token eviction for SGLang that returns real memory."""

__version__ = "0.1.0"
