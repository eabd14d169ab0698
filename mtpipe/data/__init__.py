"""The data side: Hugging Face downloads, dataset checks, the embedded default's tiny models and datasets, GSM8K as chat."""
