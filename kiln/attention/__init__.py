from kiln.attention.backend import AttentionBackend, AttentionMetadata, get_attention_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
