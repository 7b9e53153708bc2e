"""Operations around the proxy: the up supervisor, the park probe, GGUF metadata."""
