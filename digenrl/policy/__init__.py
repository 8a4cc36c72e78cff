"""The trained model: an adapter's transformer with LoRA or full weights, its optimizer, EMA and version."""
