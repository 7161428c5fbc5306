"""Device decoders: nvCOMP batch decompression of standard streams (placeholder)."""
