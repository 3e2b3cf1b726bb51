"""Files: safetensors headers, lazy/streaming/atomic tensor files, the adapter format (torch only, no modules)."""
